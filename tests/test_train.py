"""train.py end to end, on a tiny character-level dataset the tests write themselves: one process in the test's own
(helpers.run), several under torchrun with its workers new Pythons, and a new Python where a process's own end is
under test."""

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch

from helpers import (ROOT, STANDARD, TINY, assert_every_kernel_ran, assert_weights_close, kernel_counter,
                     kernel_launches, losses, new_python, run, script, standard_run, train_refusal, train_settings,
                     two_nodes, weights)
from lib.data import Split


def copy_dataset(data_dir, to, val_tokens):
    # the tests' dataset with its validation split cut to its first val_tokens tokens
    to.mkdir()
    for name in ("meta.json", "train.bin"):
        (to / name).write_bytes((data_dir / name).read_bytes())
    (to / "val.bin").write_bytes((data_dir / "val.bin").read_bytes()[:2 * val_tokens])
    return to

# -----------------------------------------------------------------------------


def test_trains_and_records_metrics(data_dir, tmp_path):
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=20", "--eval_interval=10")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in evals] == [0, 10, 20]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5  # it learns
    assert evals[-1]["val_ppl"] == pytest.approx(np.exp(evals[-1]["val_loss"]))
    assert all(0 <= r["val_accuracy"] <= 1 and 0 <= r["accuracy"] <= 1 for r in evals)
    assert evals[-1]["val_accuracy"] > evals[0]["val_accuracy"]
    train_tokens = (data_dir / "train.bin").stat().st_size // 2
    # sequences trained over the split's windows, within a window of the tokens seen over the split's tokens
    assert evals[-1]["epoch"] == pytest.approx(20 * 128 / train_tokens, rel=1e-3)
    assert f"epoch {20 * 128 / train_tokens:.2f}" in out.stdout
    steps = [r for r in records if "tokens_per_s" in r]
    assert [r["iter"] for r in steps] == list(range(1, 21))
    assert all(r["grad_norm"] > 0 and r["mem_mb"] > 0 and (r["mfu"] is None or 0 < r["mfu"] < 1) for r in steps)
    assert "tokens per update: 128 " in out.stdout
    # what an evaluation costs, said once (2 batches of each split: eval_iters)
    assert len(re.findall(r"an evaluation took [\d.]+ s \(2 train and 2 val micro-batches a process", out.stdout)) == 1
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 20 and ckpt["config"]["max_iters"] == 20
    assert ckpt["model_args"]["vocab_size"] == 64  # the data's vocabulary, padded to 64


def test_records_every_log_interval_and_saves_only_improvements_without_always_save(data_dir, tmp_path):
    # always_save_checkpoint=False: an evaluation is saved where it lowers the best val loss, and the last step; the
    # train loss of an evaluation is the train split's (its batches are not val's)
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=20", "--eval_interval=5",
              "--log_interval=5", "--always_save_checkpoint=False")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["iter"] for r in records if "tokens_per_s" in r] == [5, 10, 15, 20]
    evals, best, improved = [r for r in records if "val_loss" in r], float("inf"), {20}
    for r in evals:
        improved |= {r["iter"]} if r["val_loss"] < best and r["iter"] > 0 else set()
        best = min(best, r["val_loss"])
    assert [int(s) for s in re.findall(r"saved \S+ckpt.pt at step (\d+)", out.stdout)] == sorted(improved)
    assert len(improved) > 1 and all(r["loss"] != r["val_loss"] for r in evals)


def test_grad_clip_0_clips_nothing(data_dir, tmp_path):
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=3", "--eval_interval=100"]
    for clip in ("0", "1e9"):
        run(*common, f"--out_dir={tmp_path / clip}", f"--grad_clip={clip}")
    assert max(losses(tmp_path / "0", "grad_norm").values()) > 1  # (clipped at 1, an update would be smaller)
    a, b = weights(tmp_path / "0"), weights(tmp_path / "1e9")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sequences", ["windows", "random"])  # (their losses weighed by targets, or by micro-steps)
def test_gradient_accumulation_matches_one_big_batch(data_dir, tmp_path, sequences):
    # The two runs sum the same gradients in another order, so they differ by rounding, and the optimizer decides
    # what becomes of it. SGD moves a weight by lr x its gradient: a gradient's rounding difference stays far
    # below one ulp of the weight (measured: at most 7.5e-9 over seeds and both datasets; atol 1e-5). AdamW would
    # divide by sqrt(v) + eps, and where a gradient is below eps (1e-8) a rounding difference in it is amplified up
    # to lr / eps (1e6 here): 5e-4 for one seed, 1.1e-5 for another, on two kinds of CPU. Bugs of accumulation
    # (the last micro-batch's gradient alone, one dropped, the loss not divided) moved weights by 1e-3 to 2e-2.
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=6", "--eval_interval=100", "--optimizer=sgd",
              f"--sequences={sequences}"]
    run(*common, f"--out_dir={tmp_path / 'big'}", "--batch_size=8")
    run(*common, f"--out_dir={tmp_path / 'acc'}", "--batch_size=2", "--gradient_accumulation_steps=4")
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert big.keys() == acc.keys() == set(range(1, 7))
    assert all(abs(big[i] - acc[i]) < 1e-5 * big[i] for i in big)  # ~100 ulps of a mean of 256 losses
    assert_weights_close(weights(tmp_path / "big"), weights(tmp_path / "acc"))


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(data_dir, shared, tmp_path):
    # the standard run in one process and under DDP on 2 (helpers.standard_run: made once, read by other tests too)
    one, ddp = standard_run(shared, data_dir, "one"), standard_run(shared, data_dir, "ddp")
    assert "2 process(es) on cpu" in (ddp / "stdout.txt").read_text()
    records = [(out / "metrics.jsonl").read_text().splitlines() for out in (one, ddp)]
    assert len(records[0]) == len(records[1])  # the master's records alone
    # an evaluation reads eval_iters batches a process, each process its own: at step 0 the DDP run's val loss is
    # that of one process reading twice as many (the same sequences), their float32 sums added in another order
    run(*STANDARD, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=0", "--eval_iters=4")
    assert losses(tmp_path, "val_loss")[0] == pytest.approx(losses(ddp, "val_loss")[0], rel=1e-6)
    a, b = losses(one), losses(ddp)
    assert a.keys() == b.keys() and all(abs(a[i] - b[i]) < 1e-5 * a[i] for i in a)  # ~100 ulps of a mean loss
    # the gradients too, whose scale AdamW's steps and losses hardly show: their norms as close as the weights allow
    a, b = (losses(out, "grad_norm") for out in (one, ddp))
    assert a.keys() == b.keys() and all(abs(a[i] - b[i]) < 1e-3 * a[i] for i in a), (a, b)
    # The standard run's AdamW amplifies the rounding of a gradient below eps up to lr / eps (see
    # test_gradient_accumulation_matches_one_big_batch): measured 1.3e-6 here, and 5.1e-4 at worst in those pairs
    # of runs. A replica that trained on its own gradients alone would move weights by ~lr = 1e-2 a step.
    assert_weights_close(weights(one), weights(ddp), atol=1e-3)


@pytest.mark.slow
def test_accumulation_steps_must_divide_among_processes(data_dir, tmp_path):
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--gradient_accumulation_steps=3",
              torchrun=["--standalone", "--nproc_per_node=2"], check=False)
    assert out.returncode != 0
    assert "gradient_accumulation_steps=3 must be a multiple of the 2 data-parallel replicas" in out.stderr


@pytest.mark.slow  # two torchruns
@pytest.mark.parametrize("differs", ["learning_rate", "data"])
def test_nodes_started_with_different_settings_stop_at_start_in_one_line(data_dir, tmp_path, differs):
    # two nodes (two torchruns on this machine, as test_fault_tolerance's two-node run) whose commands differ in one
    # setting, or whose data_dir (a path of each node's own) holds a train.bin one token shorter: both stop
    # before training, each with the one line that names what differs, the rank and the node (which node holds
    # rank 0 is the rendezvous's choice)
    if differs == "data":
        other = tmp_path / "other_data"
        shutil.copytree(data_dir, other)
        size = (other / "train.bin").stat().st_size
        os.truncate(other / "train.bin", size - 2)
        node1, values = (f"--data_dir={other}",), (str(size), str(size - 2))
        what = "the size of train.bin"
    else:
        # (a wandb_run_name, which the master alone reads, may differ: nanoGPT's configs make it from the clock)
        node1, values, what = ("--learning_rate=3e-3", "--wandb_run_name=other"), ("0.01", "0.003"), "learning_rate"
    nodes = two_nodes(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=10",
                      "--gradient_accumulation_steps=2", node_args=((), node1))
    assert all(node.returncode != 0 for node in nodes), nodes
    either = "|".join(values)
    line = (rf"\[rank[01]\]: train.py: the processes were started with different settings: {what} is ({either}) on "
            rf"rank 1 \(node [01], host [^)]+\) but ({either}) on rank 0 \(give every node the same command, config "
            rf"files and data\)")
    for node in nodes:
        said = [text for text in node.stderr.splitlines() if "train.py: " in text]  # torchrun's "[rank1]: " before
        assert len(said) == 1 and re.fullmatch(line, said[0]), node.stderr[-3000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # stopped before the first step


def test_resume_continues_from_saved_step(data_dir, tmp_path):
    common = [*TINY, f"--data_dir={data_dir}", "--eval_interval=5", "--dropout=0.1"]
    run(*common, f"--out_dir={tmp_path / 'whole'}", "--max_iters=12")
    run(*common, f"--out_dir={tmp_path / 'parts'}", "--max_iters=7")
    assert torch.load(tmp_path / "parts" / "ckpt.pt", weights_only=True)["iter_num"] == 7
    out = run(*common, f"--out_dir={tmp_path / 'parts'}", "--max_iters=12", "--init_from=resume")
    assert "iter 8:" in out.stdout and "iter 7:" not in out.stdout  # continues after step 7
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts")  # bit for bit, dropout included
    assert_weights_close(weights(tmp_path / "whole"), weights(tmp_path / "parts"), atol=0)


def test_every_model_setting_reaches_the_model_its_checkpoint_and_the_resume_check(data_dir, tmp_path):
    # GPTConfig's fields are settings by themselves: qk_norm, never named in lib/settings.py, builds the norms,
    # is recorded, and a resume that changes it is refused (as a new field of GPTConfig would be, with no edit)
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2", "--eval_interval=2"]
    run(*args, "--qk_norm=True", "--head_size=16")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert "blocks.0.attn.q_norm.weight" in saved["model"] and saved["model"]["blocks.0.attn.q.weight"].shape[0] == 64
    assert saved["model_args"]["qk_norm"] is True and saved["config"]["head_size"] == 16
    said = train_refusal(*args, "--max_iters=4", "--init_from=resume", "--head_size=16", "--mlp_hidden=128")
    assert "holds a model of qk_norm=True, not qk_norm=False:" in said  # (mlp_hidden=0 is 128 at n_embd=32)
    vocab = saved["model_args"]["vocab_size"]  # 0 (the default) is whatever the checkpoint holds; another, refused
    said = train_refusal(*args, "--max_iters=4", "--init_from=resume", "--qk_norm=True", "--head_size=16",
                         f"--vocab_size={vocab + 64}")
    assert f"holds a model of vocab_size={vocab}, not vocab_size={vocab + 64}" in said


def test_windows_epochs_end_the_run_and_a_resume_in_mid_epoch_is_exact(data_dir, tmp_path):
    # sequences='windows' (the default) on a split of 640 tokens: an epoch is 21 windows of 32 (their grid's offset
    # leaves a part window at each end), 5.25 steps of 4; max_epochs=2 ends the run at the step that holds the last
    # window of epoch 2, the 11th (the tokens alone, 2 x 640 / 128, would make it 10)
    small = tmp_path / "small"
    small.mkdir()
    (small / "meta.json").write_bytes((data_dir / "meta.json").read_bytes())
    (small / "train.bin").write_bytes((data_dir / "train.bin").read_bytes()[:2 * 640])
    (small / "val.bin").write_bytes((data_dir / "val.bin").read_bytes()[:2 * 2000])
    common = [*TINY, f"--data_dir={small}", "--eval_interval=5", "--dropout=0.1", "--max_epochs=2"]
    out = run(*common, f"--out_dir={tmp_path / 'whole'}", "--max_iters=100")
    meta = json.loads((small / "meta.json").read_text())
    windows = Split(str(small), "train", meta, 32, seed=1337, examples=False, vocab_size=64)
    steps = -(-windows.sequences_in(2) // 4)
    assert (windows.sequences_in(1), windows.sequences_in(2), steps) == (21, 42, 11)
    assert f"max_epochs=2: {steps} steps" in out.stdout
    assert torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)["iter_num"] == steps
    evals = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert evals[-1]["iter"] == steps and evals[-1]["epoch"] == 2.0
    # stopped at step 7, in the middle of epoch 2 (a step before it held windows of both epochs), and resumed:
    # the uninterrupted run's losses and weights, bit for bit, dropout included
    run(*common, f"--out_dir={tmp_path / 'parts'}", "--max_iters=7")
    run(*common, f"--out_dir={tmp_path / 'parts'}", "--max_iters=100", "--init_from=resume")
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts") and len(losses(tmp_path / "whole")) == steps
    assert_weights_close(weights(tmp_path / "whole"), weights(tmp_path / "parts"), atol=0)



def test_an_epochs_checkpoint_waits_for_a_finite_gradient_as_an_evaluations_does(data_dir, tmp_path):
    # the 640 tokens' 21 windows of 32 by 4 a step: update 6 ends epoch 1. Resumed at step 5 with learning_rate=1e9,
    # that update is finite and wrecks the weights, every gradient after it is NaN: the epoch's checkpoint of them is
    # dropped, and ckpt.pt stays the one from step 5 (it had been written over, named the last good state)
    small = copy_dataset(data_dir, tmp_path / "small", 2000)
    (small / "train.bin").write_bytes((data_dir / "train.bin").read_bytes()[:2 * 640])
    common = [*TINY, f"--data_dir={small}", f"--out_dir={tmp_path / 'out'}", "--eval_interval=5", "--max_epochs=2",
              "--save_every_epoch=True"]
    run(*common, "--max_iters=5")
    before = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    said = train_refusal(*common, "--max_iters=100", "--init_from=resume", "--learning_rate=1e9",
                         "--max_skipped_steps=2")
    assert f"{tmp_path / 'out' / 'ckpt.pt'}, from step 5, is the last good state" in said
    after = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert after["iter_num"] == 5 and not (tmp_path / "out" / "ckpt_epoch_1.pt").exists()
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())


def test_an_update_split_into_micro_steps_weighs_its_part_windows_and_padding_as_one_micro_batch(data_dir, tmp_path):
    # 21 windows of 32 an epoch, two of them part windows, 8 an update: the third (last) update holds 5 and 3 of
    # padding. 4 micro-steps of 2 are one micro-batch of 8: the mean loss over the same targets, the same weights
    small = copy_dataset(data_dir, tmp_path / "small", 2000)
    (small / "train.bin").write_bytes((data_dir / "train.bin").read_bytes()[:2 * 640])
    common = [*TINY, f"--data_dir={small}", "--eval_interval=100", "--max_epochs=1", "--max_iters=100"]
    run(*common, f"--out_dir={tmp_path / 'one'}", "--batch_size=8")
    run(*common, f"--out_dir={tmp_path / 'four'}", "--batch_size=2", "--gradient_accumulation_steps=4")
    one, four = losses(tmp_path / "one"), losses(tmp_path / "four")
    assert list(one) == [1, 2, 3] and four == pytest.approx(one, rel=1e-5)
    assert_weights_close(weights(tmp_path / "one"), weights(tmp_path / "four"))

def test_batch_size_auto_keeps_the_update_and_its_micro_batch_on_resume(data_dir, tmp_path):
    # TINY's batch_size=4 x 2 micro-steps: 8 sequences an update, which a budget of 4 GiB holds in one micro-batch
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=6", "--eval_interval=3", "--dropout=0.1"]
    auto = [*common, "--gradient_accumulation_steps=2", "--batch_size=auto", "--memory_budget=4"]
    out = run(*auto, f"--out_dir={tmp_path / 'auto'}")
    assert "\nmicro-batch 8 x 1 accumulation x 1 processes x 32 tokens = 256 tokens per update\n" in out.stdout
    assert "estimated peak" in out.stdout and "of 4.00 GiB (memory_budget)" in out.stdout
    saved = torch.load(tmp_path / "auto" / "ckpt.pt", weights_only=True)["config"]
    assert (saved["batch_size"], saved["gradient_accumulation_steps"], saved["batch_size_auto"]) == (8, 1, True)
    run(*common, f"--out_dir={tmp_path / 'eight'}", "--batch_size=8")  # the same update, as a number
    assert losses(tmp_path / "auto") == losses(tmp_path / "eight")  # bit for bit
    # stopped and resumed with the same command: the micro-batch the run began with, the same losses
    run(*auto, f"--out_dir={tmp_path / 'parts'}", "--max_iters=3")
    out = run(*auto, f"--out_dir={tmp_path / 'parts'}", "--init_from=resume")
    assert "batch_size='auto': micro-batch 8, the one the run began with on cpu" in out.stdout
    assert "warning" not in out.stdout
    assert losses(tmp_path / "parts") == losses(tmp_path / "auto")
    # a budget that cannot hold one sequence: one line naming the shortfall and what would help, exit status 1
    out = run(*auto, f"--out_dir={tmp_path / 'small'}", "--memory_budget=0.01", check=False)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert re.match(r"train.py: batch_size='auto': this process holds [0-9,]+ MiB already \(Python, torch, the "
                    r"data\), and 9 MiB may be used \(90% of 10 MiB\): raise memory_budget, or leave it 0", out.stderr)


def test_batch_size_auto_evaluates_the_windows_of_the_batch_size_given(data_dir, tmp_path):
    # 4 sequences x 2 micro-steps given, one micro-batch of 8 taken: the evaluation still reads eval_iters batches
    # of 4 windows (not of 8), so the val losses are those of the run as given, to rounding (the training's are too:
    # the same update, no dropout); ckpt_best and early stopping compare like with like across a resume
    common = [*TINY, f"--data_dir={data_dir}", "--max_iters=4", "--eval_interval=2", "--gradient_accumulation_steps=2"]
    out = run(*common, f"--out_dir={tmp_path / 'auto'}", "--batch_size=auto", "--memory_budget=4")
    assert "\nmicro-batch 8 x 1 accumulation" in out.stdout
    run(*common, f"--out_dir={tmp_path / 'given'}", "--batch_size=4")
    auto, given = (losses(tmp_path / name, "val_loss") for name in ("auto", "given"))
    assert list(auto) == [0, 2, 4] and auto == pytest.approx(given, rel=1e-5)



@pytest.mark.slow
def test_batch_size_auto_shares_one_micro_step_of_an_update_over_two_processes(data_dir, tmp_path):
    # 4 sequences an update, gradient_accumulation_steps=1, over 2 replicas: 2 each in one micro-step (a number there
    # must be a multiple of the replicas; under 'auto' it is recomputed, and only the update's sequences must be)
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2", "--eval_interval=2",
              "--batch_size=auto", "--memory_budget=4", torchrun=["--standalone", "--nproc_per_node=2"])
    assert "micro-batch 2 x 1 accumulation x 2 processes x 32 tokens = 128 tokens per update" in out.stdout

# -----------------------------------------------------------------------------
# a user's mistakes end with one line naming the problem and the fix


def test_a_run_refused_after_making_its_out_dir_leaves_none(data_dir, tmp_path):
    # out_dir is made (and locked) before the data is read: a refusal there takes back the folder the run made,
    # and leaves one it found, as it was
    empty = tmp_path / "data"
    empty.mkdir()
    for out_dir, existed in ((tmp_path / "new" / "out", False), (tmp_path, True)):
        said = train_refusal(*TINY, f"--data_dir={empty}", f"--out_dir={out_dir}")
        assert "train.bin" in said and out_dir.is_dir() == existed, said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "new"]


@pytest.mark.parametrize("args,message", [
    (["--lerning_rate=0.1"], "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"),
    (["--max_iters=1.5"], "max_iters must be int like 5000, got 1.5"),
    (["--compile=yes"], "compile must be bool like False, got 'yes'"),
    (["--batch_size=AUTO"], "batch_size must be int like 4 or 'auto', got 'AUTO'"),
    (["--batch_size"], "write overrides as --key=value"),
    (["config/no_such_file.py"], "config file config/no_such_file.py: No such file or directory"),
    (["--init_from=gpt2"], "init_from='gpt2' is not 'scratch', 'resume', 'auto' or a Hugging Face model folder"),
    (["--dtype=float8"], "dtype='float8' is not one of"),
    (["--n_head=5"], "n_embd=32 must be divisible by n_head=5"),
    (["--eval_interval=0"], "eval_interval=0 must be at least 1"),
    (["--log_interval=0"], "log_interval=0 must be at least 1"),
    (["--max_iters=2*3"], "max_iters must be int like 5000, got '2*3'"),  # a value is read as a literal, never run
    (["--eval_full=True", "--eval_stride=32"], "eval_stride=32 must be at least 0 and below block_size=32"),
    (["--use_kernels=Flase"], "use_kernels='Flase' must be True, False or None (auto)"),
    # names that can never become one: the line names the setting and some of what it may be
    (["--optimizer=no-such-optimizer"], "optimizer='no-such-optimizer' is not one of 'adamw'"),
    (["--lr_schedule=no-such-schedule"], "lr_schedule='no-such-schedule' is not one of 'cosine'"),
    (["--sequences=no-such-mode"], "sequences='no-such-mode' is not one of 'windows'"),
    (["--lr_cycle_iters=0"], "lr_cycle_iters=0 must be at least 1 and lr_power=1.0 above 0"),
    (["--lr_decay_fraction=1.5"], "lr_decay_fraction=1.5 must be between 0 and 1"),
    (["--beta2=1.5"], "beta2=1.5 must be at least 0 and below 1"),
    (["--learning_rate=-1.0"], "learning_rate=-1.0 must be at least 0"),
    (["--learning_rate=1e-5"], "min_lr=6e-05 is above learning_rate=1e-05: the schedule would raise the rate"),
    (["--optimizer=sgd", "--momentum=-1.0"], "momentum=-1.0 must be at least 0 and below 1"),
    (["--seed=-1"], "seed=-1 must be at least 0"),
    (["--tp_size=0"], "tp_size=0 must be at least 1"),  # (it was told to divide the processes)
    (["--dropout=2.0"], "dropout=2.0 must be at least 0 and below 1"),
    (["--max_iters=-5"], "max_iters=-5 must be at least 0"),
    (["--max_epochs=-1"], "max_epochs=-1 must be at least 0"),
    (["--norm_eps=2.0"], "this run says norm_eps=2.0, not a number in its range: set it within its range"),
    (["--norm_eps=-0.5"], "this run says norm_eps=-0.5, not a number in its range: set it within its range"),
    (["--warmup_ratio=1.0"], "warmup_ratio=1.0 must be at least 0 and below 1"),
    (["--memory_budget=-2.0"], "memory_budget=-2.0 must be at least 0"),
    (["--memory_budget=1e400"], "memory_budget=inf must be at least 0 and finite"),
    (["--lora_rank=-4"], "lora_rank=-4 must be at least 0"),
    (["--lora_dropout=1.0"], "lora_dropout=1.0 must be at least 0 and below 1"),
    (["--lora_alpha=-1.0"], "lora_alpha=-1.0 must be at least 0"),
    (["--lora_rank=4", "--lora_alpha=0.0"], "lora_alpha=0 scales the adapters' output to nothing"),
    (["--lora_base_dtype=nf4"], "lora_base_dtype='nf4' is a setting of LoRA's adapters, and lora_rank=0 trains none"),
    (["--lora_targets=q,v"], "lora_targets='q,v' is a setting of LoRA's adapters, and lora_rank=0 trains none"),
    (["--family=banana"], "family='banana' is not one of 'llama', 'mistral', 'qwen2', 'qwen3'"),
    (["--use_kernels=1"], "use_kernels=1 must be True, False or None (auto)"),  # (1 == True: it was taken)
    (["--n_kv_head=-2"], "this run says n_kv_head=-2, not a whole number of at least 0"),  # (0: as n_head)
    (["--config=config/train_small.py"], "a config file is given as it is: python train.py config/train_small.py"),
])
def test_config_errors(data_dir, tmp_path, args, message):
    assert message in train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *args)


@pytest.mark.parametrize("args,message", [
    (["--lerning_rate=0.1"], "unknown config key 'lerning_rate' (did you mean 'learning_rate'?)"),  # configure's
    (["--eval_interval=0"], "eval_interval=0 must be at least 1"),  # settings.check's
    (["--n_head=5"], "n_embd=32 must be divisible by n_head=5"),  # the model's
])
def test_config_errors_stop_train_py_in_one_line(data_dir, tmp_path, args, message):
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", *args, check=False)
    assert out.returncode != 0 and not (tmp_path / "ckpt.pt").exists()
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("left", ["WORLD_SIZE", "RANK"])
def test_half_of_torchruns_variables_left_in_the_environment_is_one_line(data_dir, tmp_path, left):
    # WORLD_SIZE=2 alone ran one process that printed and saved two; RANK=0 alone ended in init's traceback
    value = {"WORLD_SIZE": "2", "RANK": "0"}[left]
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", check=False, env={left: value})
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and not (tmp_path / "ckpt.pt").exists()
    assert f"{left} is set but" in out.stderr and f"unset {left}" in out.stderr, out.stderr
    if left == "WORLD_SIZE":  # WORLD_SIZE=1 alone (some job environments export it) is one process, as it was
        run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'one'}", "--max_iters=1", env={left: "1"})


def test_a_resume_on_another_data_folder_says_so(data_dir, tmp_path):
    # it said nothing (a folder of the same sizes), or that the run's own folder "was prepared again"
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    shutil.copytree(data_dir, tmp_path / "copy")
    out = run(*TINY, f"--data_dir={tmp_path / 'copy'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
              "--init_from=resume").stdout
    assert (f"note: {tmp_path / 'copy'} is not the data folder of {tmp_path / 'run' / 'ckpt.pt'} ({data_dir}): the run "
            f"goes on through its sequences (those it would have seen, if a copy)") in out, out
    (tmp_path / "link").symlink_to(tmp_path / "copy")  # the checkpoint's folder by another name: no note
    out = run(*TINY, f"--data_dir={tmp_path / 'link'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=3",
              "--init_from=resume").stdout
    assert "is not the data folder" not in out, out


def test_examples_that_lose_most_of_their_tokens_to_block_size_warn(tmp_path):
    # plain text read as examples is one example (or a few), cut to a sequence: a run trained on 0.0% of it, said
    # only in a line of figures
    (tmp_path / "book.txt").write_text("".join(f"line {i} of one long text\n" for i in range(400)))
    done = script("prepare.py", tmp_path / "book.txt", "--tokenizer=char", f"--out_dir={tmp_path / 'data'}")
    assert done.returncode == 0, done.stderr
    args = [*TINY, f"--data_dir={tmp_path / 'data'}", "--max_iters=1", "--eval_iters=1"]
    out = run(*args, f"--out_dir={tmp_path / 'run'}", "--sequences=examples").stdout
    assert "warning: cut to block_size, the examples lose most of their tokens: raise block_size (plain text: " \
        "sequences='windows'" in out, out
    for i in range(60):  # short documents, each within a sequence: no warning
        (tmp_path / "notes" / f"{i}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "notes" / f"{i}.txt").write_text(f"note {i}: a short one\n")
    done = script("prepare.py", tmp_path / "notes", "--tokenizer=char", f"--out_dir={tmp_path / 'notes_data'}")
    assert done.returncode == 0, done.stderr
    many = run(*TINY, f"--data_dir={tmp_path / 'notes_data'}", f"--out_dir={tmp_path / 'many'}", "--max_iters=1",
               "--eval_iters=1", "--sequences=examples").stdout
    assert "examples: " in many and "warning: cut" not in many, many


def test_a_tilde_after_an_equals_sign_is_the_home_folder(data_dir, tmp_path, monkeypatch):
    # bash leaves --out_dir=~/run as it is (it expands --out_dir ~/run): the run went to a folder named ~
    run(*TINY, f"--data_dir={data_dir}", "--out_dir=~/run", "--max_iters=1", env={"HOME": str(tmp_path)})
    assert (tmp_path / "run" / "ckpt.pt").is_file() and not (ROOT / "~").exists()
    done = script("export.py", "--out_dir=~/elsewhere", "--to=~/hf", env={"HOME": str(tmp_path)})
    assert done.returncode == 1 and f"no checkpoint at {tmp_path}/elsewhere/ckpt.pt" in done.stderr, done.stderr
    # a config file's too (no shell sees it); ~ alone is the home folder, as the shell makes it (it made a folder ~
    # in the current one, which an rm -rf ~ meant for it would not have stopped at)
    (tmp_path / "tilde.py").write_text("out_dir = '~/from_file'\n")
    run(*TINY, f"--data_dir={data_dir}", tmp_path / "tilde.py", "--max_iters=1", env={"HOME": str(tmp_path)})
    assert (tmp_path / "from_file" / "ckpt.pt").is_file() and not (ROOT / "~").exists()
    # a prompt is text, and ~user is not taken for a folder
    from lib.files import one_line_errors
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "argv", ["sample.py", "--start=~/ a prompt", "--system=~/", "--out_dir=~root/x",
                                      "--to=~", "--data_dir=~/d"])
    monkeypatch.setenv("HOME", str(tmp_path))
    one_line_errors("sample.py")
    assert sys.argv[1:] == ["--start=~/ a prompt", "--system=~/", "--out_dir=~root/x", f"--to={tmp_path}",
                            f"--data_dir={tmp_path}/d"]


def test_config_file_is_python_and_checked(data_dir, tmp_path):
    good = tmp_path / "good.py"
    good.write_text("from math import sqrt\nmax_iters = 2\nlearning_rate = 1e-3 * sqrt(4)\neval_interval = 1\n")
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}", str(good), "--max_iters=3")
    assert "iter 3:" in out.stdout  # later overrides win
    assert torch.load(tmp_path / "o" / "ckpt.pt", weights_only=True)["config"]["learning_rate"] == 2e-3
    bad = tmp_path / "bad.py"
    bad.write_text("n_layers = 4\n")
    assert "unknown config key 'n_layers' (did you mean 'n_layer'?)" in train_refusal(str(bad))
    helper_named = tmp_path / "helper_named.py"  # a helper named as a setting would be: the file's own names begin _
    helper_named.write_text("total_tokens_wanted = 10**6\n")
    assert ("unknown config key 'total_tokens_wanted' (see lib/settings.py; a name of the file's own begins with _)"
            in train_refusal(str(helper_named)))
    latin1 = tmp_path / "latin1.py"
    latin1.write_bytes(b'out_dir = "caf\xe9"\n')
    assert "config file " + str(latin1) + ": not UTF-8 text (save it as UTF-8)" in train_refusal(str(latin1))
    nul = tmp_path / "nul.py"
    nul.write_bytes(b"max_iters = 2\0\n")
    assert f"config file {nul}: SyntaxError: source code string cannot contain null bytes" in train_refusal(str(nul))
    nan = tmp_path / "nan.py"
    nan.write_text("lr_schedule = 'polynomial'\nlr_power = float('nan')\n")
    assert "lr_power=nan above 0" in train_refusal(*TINY, str(nan))
    helper = tmp_path / "helper.py"  # a file's function reads the file's own names, and may set a setting
    helper.write_text("_width = 16\ndef _heads():\n    return _width // 8\nn_embd = _width\nn_head = _heads()\n"
                      "def _more():\n    global max_iters\n    max_iters = 7\n_more()\ndel n_layer\n"
                      "_steps = [(eval_interval := i) for i in range(1, 4)]\n")
    assert {k: train_settings([helper])[k] for k in ("n_head", "n_embd", "max_iters", "n_layer", "eval_interval")} \
        == {"n_head": 2, "n_embd": 16, "max_iters": 7, "n_layer": 6, "eval_interval": 3}
    for text, data in (("dataset = 'bb'\ndata_dir = 'aa'\n", "aa"), ("data_dir = 'aa'\ndataset = 'bb'\n", "data/bb")):
        (tmp_path / "order.py").write_text(text)  # nanoGPT's dataset and our data_dir: the one stored last wins
        assert train_settings([tmp_path / "order.py"])["data_dir"] == data
    later = tmp_path / "later.py"  # the last value a file gives a setting, however it gives it
    later.write_text("max_iters = 100\nglobals()['max_iters'] = 200\n")
    assert train_settings([later])["max_iters"] == 200
    for text, fix in (("compile = false\n", "(Python's is False)"), ("dtype = bfloat16\n", "(a text is quoted")):
        (tmp_path / "names.py").write_text(text)  # another language's word, a text unquoted: named with the fix
        assert f"line 1: NameError: name '{text.split()[-1]}' is not defined {fix}" in train_refusal(
            str(tmp_path / "names.py"))
    huge = tmp_path / "huge.py"  # an int past any float: the type's line, no traceback
    huge.write_text("learning_rate = 10**400\n")
    assert "learning_rate must be float like " in train_refusal(str(huge))
    for name, text, line in (("run.yaml", "eval_interval = 1\nmax_iters: 2\n", "line 2: 'max_iters: 2'"),
                             ("paged.yaml", "eval_interval = 1\n\f\nmax_iters: 2\n", "line 3: 'max_iters: 2'"),
                             ("run.json", '{"max_iters": 2,\n "lr": 0.1}\n', "line 1: '{\"max_iters\": 2,'")):
        other = tmp_path / name  # another format's file, read as Python, had set nothing (and the run went on)
        other.write_text(text)
        assert f"config file {other}, {line} sets nothing; a config file is Python: write key = value" in \
            train_refusal(str(other))
    for given in ("max_iters=3", "-max_iters=3"):
        assert "(give a path like config/train_small.py; a setting is --max_iters=3)" in train_refusal(given)
    bom = tmp_path / "bom.py"  # UTF-8 as some Windows editors save it, a byte-order mark first
    bom.write_bytes(b"\xef\xbb\xbfmax_iters = 3\n")
    assert train_settings([bom])["max_iters"] == 3
    # nanoGPT's dataset='NAME' is data_dir='data/NAME': of the two, the one given later wins
    assert train_settings(["config/train_shakespeare_char.py", "--dataset=owt"])["data_dir"] == "data/owt"
    assert train_settings(["--dataset=owt", "config/train_shakespeare_char.py"])["data_dir"] == "data/shakespeare_char"
    # an assignment counts where it ran: one under an if that was false leaves 'auto' on (it had turned it off)
    maybe = tmp_path / "maybe.py"
    maybe.write_text("import os\nif os.environ.get('NO_SUCH_VARIABLE'):\n    batch_size = 64\n")
    assert train_settings(["--batch_size=auto", maybe])["batch_size_auto"] is True
    # the file's locals() are its settings still, written as any store is; dataset and data_dir in their last order
    spoken = tmp_path / "spoken.py"
    spoken.write_text("locals().update(max_iters=42)\nlearning_rate = max_iters / 1e4\n"
                      "dataset = 'a'\ndata_dir = 'x'\ndataset = 'b'\n")
    assert {k: train_settings([spoken])[k] for k in ("max_iters", "learning_rate", "data_dir")} == \
        {"max_iters": 42, "learning_rate": 42 / 1e4, "data_dir": "data/b"}
    assert train_settings(["--batch_size=auto", "--batch_size=12"])["batch_size_auto"] is False
    # a setting whose default is None takes None back (it had kept the type of the value it had been given)
    assert train_settings(["--use_kernels=True", "--use_kernels=None"])["use_kernels"] is None
    # init_from='auto' after a folder keeps the folder, which resumes its run where out_dir holds one, as auto
    # would (slurm.sbatch gives --init_from=auto after a fine-tune's config: it had trained a new model)
    assert train_settings(["--init_from=models/Qwen3-0.6B", "--init_from=auto"])["init_from"] == "models/Qwen3-0.6B"
    assert train_settings(["--init_from=resume", "--init_from=auto"])["init_from"] == "auto"
    helped = run("--help", check=False)
    assert helped.returncode == 0 and "lib/settings.py" in helped.stdout and not helped.stderr


def test_data_errors(data_dir, tmp_path):
    def data_refusal(data_dir, *args):  # (train_refusal: train.py's checks, in process)
        return train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", *args)
    assert "prepare the data first (python prepare.py --out_dir=" in (said := data_refusal(tmp_path / "nothing"))
    assert "or nanoGPT's data/NAME/prepare.py, whose folder train.py reads as it is" in said  # (its meta.pkl too)
    too_small = json.loads((data_dir / "meta.json").read_text())["vocab_size"] - 1
    assert f"model's vocab_size is {too_small}" in data_refusal(data_dir, f"--vocab_size={too_small}")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("meta.json", "val.bin"):
        (corrupt / name).write_bytes((data_dir / name).read_bytes())
    (corrupt / "train.bin").write_bytes((data_dir / "train.bin").read_bytes()[:-1])  # half a token
    assert "not a whole number of uint16 tokens" in data_refusal(corrupt)
    (corrupt / "prepare.incomplete").write_text("prepare.py was killed here\n")
    assert "is a dataset prepare.py did not finish (re-run prepare.py)" in data_refusal(corrupt)
    (corrupt / "meta.json").write_text("{not json")
    (corrupt / "prepare.incomplete").unlink()
    assert "meta.json is damaged" in data_refusal(corrupt)
    # and train.py stops on them in one line, writing nothing
    out = run(*TINY, f"--data_dir={corrupt}", f"--out_dir={tmp_path / 'out'}", check=False)
    assert out.returncode != 0 and "meta.json is damaged" in out.stderr and len(out.stderr.splitlines()) == 1
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def test_a_finished_run_is_never_overwritten_and_auto_resumes(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=4"]
    run(*args, "--max_iters=4")
    before = (tmp_path / "ckpt.pt").read_bytes()
    out = run(*args, "--max_iters=8", check=False)  # the same command again, without resume
    assert out.returncode != 0 and "holds a run already (ckpt.pt, ckpt_best.pt): continue it with --init_from=resume" in out.stderr
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    out = run(*args, "--max_iters=8", "--init_from=auto")
    assert "iter 5:" in out.stdout and torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 8


def test_a_run_no_evaluation_of_which_beats_step_0_says_it_wrote_no_best(data_dir, tmp_path):
    # a fine-tune that only gets worse than the model it began from never writes ckpt_best: the run's end and the
    # scripts that read ckpt_best say why (learning_rate=0: every evaluation equals step 0's)
    from lib.files import UserError
    from lib.trained import load_model
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2", "--eval_interval=1",
              "--learning_rate=0", "--min_lr=0")
    assert re.search(r"note: no evaluation after step 0 lowered the best val loss \d\.\d{4}, so no ckpt_best was "
                     r"written: the model the run began from scored best \(lower learning_rate\)", out.stdout)
    assert (tmp_path / "ckpt.pt").exists() and not (tmp_path / "ckpt_best.pt").exists()
    # a resume (here in a folder a step copy was taken into) whose evaluations did not beat the best before it: that
    # best came from the run it continues (the note blamed the step 0 it never had)
    resumed = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=3", "--eval_interval=1",
                  "--learning_rate=0", "--min_lr=0", "--init_from=resume").stdout
    assert "note: no evaluation of this resume lowered the best val loss" in resumed and "it came before the " \
        "checkpoint resumed from, whose run's ckpt_best (if any) this out_dir lacks" in resumed, resumed
    with pytest.raises(UserError, match=r"\(a run writes ckpt_best once an evaluation after step 0 lowers its val "
                                        r"loss\)$"):
        load_model(str(tmp_path / "ckpt_best.pt"))
    assert "no ckpt_best" not in run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'b'}",
                                     "--max_iters=2", "--eval_interval=1").stdout


def test_resume_without_checkpoint(data_dir, tmp_path):
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume")
    assert f"no checkpoint at {tmp_path}/ckpt.pt" in said


def test_raw_folder_to_prepare_to_train_to_sample(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    for i in range(20):
        (corpus / ("sub" if i % 2 else "") / f"doc{i}.txt").write_text(f"hello world number {i}.\n" * 50)
    data = tmp_path / "data"
    prep = script("prepare.py", corpus, f"--out_dir={data}", "--tokenizer=char")
    assert prep.returncode == 0, prep.stderr
    out = tmp_path / "out"
    run(*TINY, f"--data_dir={data}", f"--out_dir={out}", "--max_iters=30", "--eval_interval=30")
    done = script("sample.py", f"--out_dir={out}", "--start=hello", "--num_samples=2", "--max_new_tokens=40",
                  "--temperature=0")
    assert done.returncode == 0, done.stderr
    samples = done.stdout.split("---------------\n")[:-1]
    assert len(samples) == 1 and "greedy" in done.stderr  # greedy: two samples would be the same text twice
    text = samples[0].rstrip("\n")
    assert text.startswith("hello") and len(text.replace("<|endoftext|>", "#")) == len("hello") + 40
    assert set(text.replace("<|endoftext|>", "")) <= set("hello world number 0123456789.\n")
    # --top_k=0 samples among every token, as a top_k past the vocabulary does (transformers' 0 is off too)
    drawn = [script("sample.py", f"--out_dir={out}", "--start=hello", "--num_samples=1", "--max_new_tokens=40",
                    "--temperature=1.5", top_k).stdout for top_k in ("--top_k=0", "--top_k=100000", "--top_k=2")]
    assert drawn[0] and drawn[0] == drawn[1] != drawn[2]

    # from another folder too: the checkpoint knows where its data and tokenizer are
    elsewhere = script(ROOT / "sample.py", f"--out_dir={out}", "--start=hello", "--num_samples=1",
                       "--max_new_tokens=40", "--temperature=0", cwd=tmp_path)
    assert elsewhere.returncode == 0 and elsewhere.stdout == samples[0] + "---------------\n"
    for bad, message in [("--start=FILE:/no/such/prompt.txt", "cannot read the prompt file"),
                         ("--start=héllo", "the prompt cannot be encoded: character 'é'"),
                         ("--top_k=-1", "--top_k=-1 must be at least 0"),
                         # numbers that made a traceback, or sampled the least likely tokens, checked as settings are
                         ("--temperature=-0.5", "--temperature=-0.5 must be at least 0"),
                         ("--temperature=nan", "--temperature=nan must be at least 0"),
                         ("--temperature=inf", "--temperature=inf must be at least 0"),
                         ("--top_p=-0.5", "--top_p=-0.5 must be at least 0 and at most 1"),
                         ("--top_p=1.5", "--top_p=1.5 must be at least 0 and at most 1"),
                         ("--num_samples=0", "--num_samples=0 must be at least 1"),
                         ("--system=Be terse.", "--system is the system prompt of --chat")]:  # (else dropped)
        done = script("sample.py", f"--out_dir={out}", bad)
        assert done.returncode != 0 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    done = script("sample.py", "--model=/no/such/folder")
    assert done.returncode == 1 and done.stderr.startswith("sample.py: --model=/no/such/folder is no folder: name a")
    for bad, message in [("--batch_size=0", "--batch_size=0 must be at least 1"),
                         ("--stride=-1", "--stride=-1 must be at least 0"),
                         ("--block_size=100000", "--block_size=100000 must be in 1..32 (the model's limit)\n"),
                         # the tasks' settings without --tasks: the val loss, and the setting unused (no --output)
                         ("--limit=5", "--limit is a setting of --tasks"),
                         ("--output=x.json", "--output is a setting of --tasks")]:
        done = script("eval.py", f"--out_dir={out}", bad)
        assert done.returncode != 0 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    done = script("eval.py", f"--out_dir={out}", "--tasks=any", "--stride=3")  # the reverse: the tasks' own window
    assert done.returncode == 1 and "--stride is a setting of the val loss, not of --tasks" in done.stderr


@pytest.mark.slow
def test_bench_runs_train_both_ways_and_reports_a_table():
    for bad, message in [("--warmup=-1", "--warmup=-1 must be at least 0"), ("--seconds=0", "--seconds=0 above 0")]:
        done = script("bench.py", "--synthetic", bad, *TINY)
        assert done.returncode == 1 and message in done.stderr, done.stderr
    done = script("bench.py", "--synthetic", "--compare=tie_embeddings", "--steps=4", "--warmup=1", *TINY)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| tie_embeddings=")]
    assert [r[0].strip() for r in rows] == ["tie_embeddings=False", "tie_embeddings=True"]
    assert all(float(r[1].replace(",", "")) > 0 and r[3].strip()[-1] in "%a" for r in rows)  # n/a: peak unknown
    assert "speedup of tie_embeddings=True:" in done.stdout


@pytest.mark.slow  # wandb's import alone is seconds
def test_wandb_logging_offline(data_dir, tmp_path):
    # in a new Python: wandb writes its records out, and ends the service process it starts, as the process ends
    done = new_python("train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=3",
                      "--eval_interval=3", "--wandb_log=True", "--device=cpu",
                      env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert done.returncode == 0, done.stderr[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1  # the run's records, kept for `wandb sync`
    records = runs[0].read_bytes()
    assert all(key in records for key in (b"val_loss", b"tokens_per_s", b"grad_norm"))


@pytest.mark.slow
def test_ddp_with_the_triton_kernels_matches_the_plain_ops(data_dir, tmp_path):
    # the fused ops (under Triton's interpreter on CPU: slow, so a tiny batch) inside DDP, against the plain ops in
    # one process on the same micro-batches (DDP's replicas are one process's micro-steps:
    # test_ddp_two_processes_match_one_process)
    # SGD: the weights differ by the two ops' rounding, which AdamW would amplify (test_gradient_accumulation_...)
    args = [*TINY, f"--data_dir={data_dir}", "--block_size=16", "--batch_size=1", "--max_iters=2",
            "--eval_interval=2", "--eval_iters=1", "--gradient_accumulation_steps=2", "--optimizer=sgd"]
    ddp = ["--standalone", "--nproc_per_node=2"]
    counter = kernel_counter(tmp_path)
    out = run(*args, f"--out_dir={tmp_path / 'fused'}", "--use_kernels=True", counter, torchrun=ddp,
              env={"TRITON_INTERPRET": "1"})
    assert_every_kernel_ran(out.stdout)
    assert len(kernel_launches(out.stdout)) == 2  # in both processes
    run(*args, f"--out_dir={tmp_path / 'plain'}", "--use_kernels=False")
    fused, plain = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert fused.keys() == plain.keys() == {1, 2} and all(abs(fused[i] - plain[i]) < 1e-5 for i in fused)
    a, b = weights(tmp_path / "fused"), weights(tmp_path / "plain")
    assert_weights_close(a, b)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # other arithmetic ran: not the plain ops again
    ckpt = torch.load(tmp_path / "fused" / "ckpt.pt", weights_only=True)
    assert ckpt["model_args"]["use_kernels"] is True


@pytest.mark.slow
def test_float16_with_the_triton_kernels_trains(data_dir, tmp_path):
    # fp16 autocast and the gradient scaler around the fused ops (interpreter on CPU)
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--block_size=16", "--batch_size=1",
              "--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--dtype=float16", "--use_kernels=True",
              kernel_counter(tmp_path), env={"TRITON_INTERPRET": "1"})
    assert "float16" in out.stdout and "skipped" not in out.stdout
    assert_every_kernel_ran(out.stdout)
    assert all(np.isfinite(v) for v in losses(tmp_path).values()) and len(losses(tmp_path)) == 3


@pytest.mark.slow  # sample.py in the quick tier: the raw folder's run to its sample
def test_sample_finds_the_tokenizer_or_says_why_not(data_dir, tmp_path):
    # data_dir is a char dataset without a vocabulary file (meta.json only): copy what sample.py needs
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2", "--eval_interval=2")
    moved = tmp_path / "moved"
    out = script("sample.py", f"--out_dir={tmp_path / 'out'}", f"--data_dir={moved}")
    assert out.returncode != 0 and f"--data_dir={moved} is not a folder: give a prepared dataset's" in out.stderr
    moved.mkdir()
    # another tokenizer's data (GPT-2's): the checkpoint's fingerprint of its own data's tokenizer tells them apart
    (moved / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
                                                 "tokenizer": {"kind": "tiktoken", "name": "gpt2"}}))
    out = script("sample.py", f"--out_dir={tmp_path / 'out'}", f"--data_dir={moved}")
    assert out.returncode != 0 and len(out.stderr.splitlines()) == 1, out.stderr
    assert f"{moved} was not prepared with the tokenizer {tmp_path / 'out' / 'ckpt.pt'} was trained with" in out.stderr


# -----------------------------------------------------------------------------
# the recipe: document masking, TensorBoard (the schedules: test_schedule.py)


def test_doc_mask_trains_and_needs_an_end_of_text_id(data_dir, tmp_path):
    # the tests' data has eot_id 0 (a newline): every line is a document
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'masked'}", "--max_iters=10", "--eval_interval=10",
        "--doc_mask=True")
    evals = [json.loads(line) for line in (tmp_path / "masked" / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in line]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.5
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("train.bin", "val.bin"):
        (plain / name).write_bytes((data_dir / name).read_bytes())
    (plain / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 62}))  # no eot_id
    said = train_refusal(*TINY, f"--data_dir={plain}", f"--out_dir={tmp_path / 'o'}", "--doc_mask=True")
    assert "doc_mask=True needs the end-of-text id" in said  # (train.py's checks, in process)


def test_sample_py_attends_within_documents_as_a_doc_mask_run_did(tmp_path):
    # its text is generate(document=end-of-text)'s, which parts from one seeing every document before (at a low
    # temperature, where the draws follow the logits closely)
    (tmp_path / "src").mkdir()
    rng = np.random.default_rng(0)
    for i in range(300):  # short documents, of which a sample writes several
        (tmp_path / "src" / f"d{i}.txt").write_text(" ".join(rng.choice(["the", "cat", "sat", "on", "a"], 3)))
    assert script("prepare.py", tmp_path / "src", "--tokenizer=char", f"--out_dir={tmp_path / 'data'}").returncode == 0
    run(*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=30",
        "--eval_interval=30", "--doc_mask=True")
    from lib.trained import load_run
    model, tokenizer, _ = load_run(str(tmp_path / "run" / "ckpt.pt"))
    ids = torch.tensor([tokenizer.encode("the", bos=True)])

    def sampled(**document):
        torch.manual_seed(0)
        return model.eval().generate(ids, 80, temperature=0.3, vocab=tokenizer.vocab_size, **document)[0].tolist()
    within = sampled(document=tokenizer.eot_id)
    assert within != sampled() and within.count(tokenizer.eot_id) >= 3
    done = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--start=the", "--temperature=0.3", "--top_k=0",
                  "--seed=0", "--num_samples=1", "--max_new_tokens=80")
    assert done.returncode == 0 and done.stdout == tokenizer.decode(within) + "\n---------------\n", done.stdout


def test_tensorboard_gets_the_records_of_metrics_jsonl(data_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is optional and not installed here")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=2",
        "--tensorboard_log=True")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"loss", "lr", "epoch", "tokens_per_s", "eval/loss", "eval/val_loss", "eval/lr"} <= set(scalars)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["iter"]: r["val_loss"] for r in records if "val_loss" in r}
    assert {e.step: e.value for e in events.Scalars("eval/val_loss")} == pytest.approx(val)
    # a step's update and its evaluation share a step: each keeps its own train loss and lr, one value a step
    for tag, key in (("loss", "loss"), ("eval/loss", "loss"), ("lr", "lr")):
        steps = [e.step for e in events.Scalars(tag)]
        mine = {r["iter"]: r[key] for r in records if ("val_loss" in r) == tag.startswith("eval/")}
        assert len(steps) == len(set(steps)) and {e.step: e.value for e in events.Scalars(tag)} == pytest.approx(mine)


def test_wandb_that_does_not_start_is_one_line(data_dir, tmp_path, monkeypatch):
    # not logged in, or no network: wandb.init raises one of its own errors, named in one line with the fix
    def init(**kwargs):
        raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login(key=[your_api_key])")
    monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))
    monkeypatch.setattr(sys.modules["wandb"], "init", init, raising=False)
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}", "--wandb_log=True")
    assert said == ("wandb_log=True: Weights & Biases did not start (api_key not configured (no-tty)): run `wandb "
                    "login`, or set wandb_log=False")


def test_tensorboard_missing_is_one_line(data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import fails
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}", "--tensorboard_log=True")
    assert "tensorboard_log=True needs TensorBoard: pip install tensorboard" in said
    monkeypatch.setitem(sys.modules, "wandb", None)  # (a traceback after the model was built)
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'o'}", "--wandb_log=True")
    assert "wandb_log=True needs Weights & Biases: pip install wandb" in said


def test_a_new_run_keeps_the_records_of_one_that_left_no_checkpoint_aside(data_dir, tmp_path):
    # a finished run's checkpoints moved away, a new run in its out_dir: its metrics.jsonl, the run's only history
    # left, was removed without a word
    out = tmp_path / "run"
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=2", "--log_interval=1"]
    run(*args)
    first = (out / "metrics.jsonl").read_text()
    for path in out.glob("ckpt*.pt"):
        path.rename(tmp_path / path.name)
    done = run(*args)
    assert "note: metrics.jsonl of an earlier run that left no checkpoint here kept as metrics.jsonl.old" in done.stdout
    assert (out / "metrics.jsonl.old").read_text() == first
    assert (out / "metrics.jsonl").read_text().count("\n") == first.count("\n")  # this run's own records alone


def test_a_metrics_jsonl_that_cannot_be_removed_or_written_is_a_warning(data_dir, tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()  # (a fresh run's removal of a stale one had ended in a traceback)
    (tmp_path / "metrics.jsonl.old").write_text("")  # (and a folder is not moved over a file)
    done = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2")
    assert f"warning: cannot write {tmp_path}/metrics.jsonl (Is a directory); training goes on without it" \
        in done.stdout and "run ended at step 2" in done.stdout


@pytest.mark.slow
def test_bench_races_optimizers_on_equal_time(data_dir):
    done = script("bench.py", "--mode=race", "--seconds=0.5", "--steps=4", "--warmup=1", "--run=--optimizer=adamw",
                  "--run=--optimizer=sgd --learning_rate=0.1", *TINY, f"--data_dir={data_dir}")
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| optimizer=")]
    assert [r[0].strip() for r in rows] == ["optimizer=adamw", "optimizer=sgd learning_rate=0.1"]
    for name, ms, steps, seconds, loss, accuracy in rows:
        assert int(steps) >= 1 and float(seconds) > 0 and 0 < float(loss) < 10 and accuracy.strip().endswith("%")


def test_eval_py_refuses_a_val_split_with_nothing_to_score(data_dir, tmp_path):
    # one token of val.bin: nothing predicts it, so there is no loss to give (not 0, perplexity 1, over 0 tokens)
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    one = copy_dataset(data_dir, tmp_path / "one", val_tokens=1)
    done = script("eval.py", f"--out_dir={tmp_path / 'run'}", f"--data_dir={one}", "--device=cpu")
    assert done.returncode != 0 and "val.bin has nothing to score" in done.stderr, done.stdout + done.stderr
    assert "perplexity" not in done.stdout
    # a val.bin of part tokens, or of fewer than meta.json counts: refused as train.py refuses it, not scored
    for cut, said in [(1001, "not a whole number of uint16 tokens"), (1000, "holds 500 uint16 tokens where meta.json")]:
        part = copy_dataset(data_dir, tmp_path / f"part{cut}", val_tokens=0)
        (part / "val.bin").write_bytes((data_dir / "val.bin").read_bytes()[:cut])
        meta = json.loads((data_dir / "meta.json").read_text())
        meta["val"] = {**meta.get("val", {}), "tokens": (data_dir / "val.bin").stat().st_size // 2}
        (part / "meta.json").write_text(json.dumps(meta))
        done = script("eval.py", f"--out_dir={tmp_path / 'run'}", f"--data_dir={part}", "--device=cpu")
        assert done.returncode == 1 and said in done.stderr and "val loss" not in done.stdout, done.stderr


def test_eval_py_takes_the_dtype_given_and_a_loss_past_a_floats_range_has_perplexity_inf(data_dir, tmp_path,
                                                                                          monkeypatch):
    # --dtype given wins over the run's own (bfloat16 here); e^800 is past a float: inf, not an OverflowError
    from model import GPT
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=1", "--dtype=bfloat16")
    done = script("eval.py", f"--out_dir={tmp_path}", "--device=cpu")
    assert done.returncode == 0 and "; computed in bfloat16" in done.stdout, done.stdout + done.stderr
    done = script("eval.py", f"--out_dir={tmp_path}", "--device=cpu", "--dtype=float32")
    assert done.returncode == 0 and "; computed in float32" in done.stdout, done.stdout + done.stderr
    monkeypatch.setattr(GPT, "loss_and_accuracy", lambda *args: (torch.tensor(800.0), torch.tensor(0.0)))
    done = script("eval.py", f"--out_dir={tmp_path}", "--device=cpu")
    assert done.returncode == 0 and "val loss 800.000000 perplexity inf over " in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # eval_full in the quick tier: test_sft.py's, on conversations
def test_eval_full_scores_the_whole_val_split_as_eval_py_does(data_dir, tmp_path):
    # eval_full: every token of val.bin once, in windows of 32 overlapping by 8; the same loss eval.py reports
    # for the checkpoint (by default in the run's windows, attending within documents as its doc_mask did), and
    # again the same on a second evaluation of the same weights. The validation split cut to 3,001 tokens (not a
    # whole number of windows) keeps the four evaluations of every token short.
    data_dir = copy_dataset(data_dir, tmp_path / "data", val_tokens=3001)
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=4",
        "--eval_full=True", "--eval_stride=8", "--doc_mask=True")
    val = [json.loads(line)["val_loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
           if "val_loss" in line]
    done = script("eval.py", f"--out_dir={tmp_path}", "--device=cpu")
    assert done.returncode == 0 and "overlapping by 8" in done.stdout and "within documents" in done.stdout, done
    last = done.stdout.strip().splitlines()[-1]
    val_tokens = (data_dir / "val.bin").stat().st_size // 2
    assert last.endswith(f"over {val_tokens - 1} tokens")  # every token but the first, once
    assert float(last.split()[2]) == pytest.approx(val[-1], abs=1e-5)
    again = script("eval.py", f"--out_dir={tmp_path}", "--stride=8", "--device=cpu", "--batch_size=3")
    assert again.stdout.strip().splitlines()[-1].split()[2] == last.split()[2]  # deterministic, any batching
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'bad'}", "--eval_full=True",
              "--eval_stride=32", check=False)
    assert "eval_stride=32 must be at least 0 and below block_size=32" in out.stderr
    # eval_stride left out: half a window, whatever block_size is, as eval.py's default (its windows here)
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'half'}", "--max_iters=1", "--eval_full=True")
    assert "every token of val.bin once, in windows overlapping by 16" in out.stdout
    done = script("eval.py", f"--out_dir={tmp_path / 'half'}", "--device=cpu")
    val = json.loads((tmp_path / "half" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert "overlapping by 16" in done.stdout and float(done.stdout.split()[-6]) == pytest.approx(val, abs=1e-5)
    # a bfloat16 run is scored in bfloat16, as its evaluations were (auto had been float32 on a CPU: 1e-4 apart)
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'bf16'}", "--max_iters=8", "--eval_interval=8",
        "--eval_full=True", "--dtype=bfloat16", "--learning_rate=3e-2")
    done = script("eval.py", f"--out_dir={tmp_path / 'bf16'}", "--device=cpu")
    val = json.loads((tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    assert done.stdout.splitlines()[0].endswith("; computed in bfloat16")
    assert float(done.stdout.split()[-6]) == pytest.approx(val, abs=1e-5)
