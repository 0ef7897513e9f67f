"""Past one device's memory: FSDP2 (fsdp=True) and its sharded checkpoints, on CPU with gloo.

Each torchrun launch costs 10-20 s here, so each test makes several checks on the runs it starts."""

import importlib.util
import os
import random
import re
import shutil
import time

import pytest
import torch

from lib.checkpoint import find_checkpoint
from lib.resume import load_checkpoint
from test_fault_tolerance import kill, start, wait_for
from helpers import (EXACT, STANDARD, TINY, assert_every_kernel_ran, assert_no_kernel_ran, assert_weights_close,
                     exact_fsdp_run, kernel_counter, losses, master_reads, run, script, standard_run, train_refusal,
                     two_nodes, weights)

pytestmark = pytest.mark.slow  # every test here starts torchrun
TWO = ["--standalone", "--nproc_per_node=2"]
FOUR = ["--standalone", "--nproc_per_node=4"]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
if HAS_TRANSFORMERS:
    from test_finetune import FINETUNE, LORA, pretrained  # noqa: F401 (pretrained: a fixture)


def assert_close_losses(a, b, steps, rel=1e-4):
    assert set(steps) <= a.keys() and set(steps) <= b.keys(), (a, b)
    assert all(abs(a[i] - b[i]) <= rel * abs(b[i]) for i in steps), (a, b)


def whole_checkpoint(path):
    # every tensor of a sharded checkpoint, whole, in one process: model, optimizer state and state.pt's
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(path, path.parent / f"{path.name}.whole.pt")
    return torch.load(path.parent / f"{path.name}.whole.pt", weights_only=False)


# -----------------------------------------------------------------------------
# FSDP gives DDP's losses, and its checkpoints load into other layouts


def test_fsdp_matches_ddp_and_its_checkpoint_resumes_in_other_layouts(data_dir, tmp_path, shared):
    # DDP's run is the standard one (helpers.standard_run: 8 steps on 2 processes, made once, read only)
    args = [*STANDARD, f"--data_dir={data_dir}"]
    ddp_dir = standard_run(shared, data_dir, "ddp")
    out = run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--max_iters=4", "--fsdp=True", "--keep_last_n=1",
              torchrun=TWO)
    ddp, fsdp = losses(ddp_dir), losses(tmp_path / "fsdp")
    assert_close_losses(fsdp, ddp, range(1, 5))
    # on disk: a folder in place of ckpt.pt, one file of shards per process, each about half of the whole;
    # the best and the last step beside it, older steps pruned
    assert f"saved {tmp_path / 'fsdp' / 'ckpt'} at step 4" in out.stdout
    names = sorted(os.listdir(tmp_path / "fsdp"))
    assert names == ["ckpt", "ckpt_0000004", "ckpt_best", "metrics.jsonl"], names
    shards = sorted((tmp_path / "fsdp" / "ckpt").glob("*.distcp"))
    assert len(shards) == 2 and (tmp_path / "fsdp" / "ckpt" / "state.pt").exists()
    sizes = [s.stat().st_size for s in shards]
    assert max(sizes) < 0.6 * sum(sizes)  # nothing gathered whole on one process
    state = torch.load(tmp_path / "fsdp" / "ckpt" / "state.pt", weights_only=True)
    assert state["iter_num"] == 4 and state["world_size"] == 2 and "model" not in state
    # into 1 process without fsdp (the out_dir keeps its layout: shards, written by one process), and into 4
    one = tmp_path / "one"
    one.mkdir()
    shutil.copytree(tmp_path / "fsdp" / "ckpt_0000004", one / "ckpt")
    run(*args, f"--out_dir={one}", "--max_iters=6", "--init_from=resume")
    assert_close_losses(losses(one), ddp, [5, 6])
    assert (one / "ckpt" / "state.pt").exists() and not (one / "ckpt.pt").exists()
    assert load_checkpoint(str(one / "ckpt"), weights=False)["iter_num"] == 6
    # and into 4 processes as FSDP x tensor parallel (2 replicas of 2), with gradient checkpointing: the shards of
    # 2 processes loaded into 4, each holding parts of other shapes, and that layout's steps (one launch of 4
    # processes for the three changes: ~30 s each here)
    out = run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--max_iters=6", "--fsdp=True", "--tp_size=2",
              "--gradient_checkpointing=True", "--init_from=resume", torchrun=FOUR)
    assert "4 process(es)" in out.stdout and "warning" not in out.stdout
    assert "| FSDP x2 + TP x2 + checkpointing |" in out.stdout
    assert_close_losses(losses(tmp_path / "fsdp"), ddp, [5, 6])
    assert len(list((tmp_path / "fsdp" / "ckpt").glob("*.distcp"))) == 4
    # and a single file into shards: DDP's ckpt.pt of step 6, resumed under FSDP on 2, which gathers its shards
    # into ckpt.pt again (the out_dir's layout), the checkpoint a plain run resumes from
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(ddp_dir / "ckpt_0000006.pt", files / "ckpt.pt")
    run(*args, f"--out_dir={files}", "--max_iters=8", "--fsdp=True", "--init_from=auto", torchrun=TWO)
    assert_close_losses(losses(files), ddp, [7, 8])
    assert find_checkpoint(str(files / "ckpt.pt")) == str(files / "ckpt.pt") and not (files / "ckpt").exists()
    gathered, plain = torch.load(files / "ckpt.pt", weights_only=True), torch.load(ddp_dir / "ckpt.pt",
                                                                                  weights_only=True)
    assert gathered["iter_num"] == 8 and gathered["model"].keys() == plain["model"].keys()
    assert all(torch.allclose(gathered["model"][k], plain["model"][k], atol=1e-5) for k in plain["model"])
    def groups(checkpoint):  # (the optimizer FSDP loaded holds its betas as a list, torch's own a tuple)
        return [{**group, "betas": tuple(group["betas"])} for group in checkpoint["optimizer"]["param_groups"]]
    assert groups(gathered) == groups(plain)
    assert gathered["optimizer"]["state"].keys() == plain["optimizer"]["state"].keys()


def test_fsdp_bf16_mixed_precision_matches_one_process_in_bf16(data_dir, tmp_path):
    # FSDP's bf16 policy (bf16 weights gathered, gradients reduced in fp32, fp32 shards kept) against one process
    # under bf16 autocast (the same tokens per update: test_parallel's runs give one process's losses), with gloo
    # on CPU: bf16 on these CPUs is slow, so a few steps of the tiny model. The two round differently (FSDP's
    # residual stream is bf16, autocast's fp32: docs/scaling.md), so the losses agree to bf16's precision, not fp32's;
    # measured here, ~2e-4 apart after 4 steps.
    args = [*TINY, f"--data_dir={data_dir}", "--batch_size=2", "--gradient_accumulation_steps=2",
            "--eval_interval=4", "--max_iters=4", "--dtype=bfloat16"]
    run(*args, f"--out_dir={tmp_path / 'one'}")
    out = run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--fsdp=True", torchrun=TWO)
    assert "2 process(es) on cpu, bfloat16" in out.stdout
    one, fsdp = losses(tmp_path / "one"), losses(tmp_path / "fsdp")
    assert_close_losses(fsdp, one, range(1, 5), rel=2e-3)
    assert fsdp != one  # bf16 weights really were gathered: the rounding differs from autocast's
    whole = whole_checkpoint(tmp_path / "fsdp" / "ckpt")  # the shards stayed fp32 master weights
    assert all(t.dtype == torch.float32 for t in whole["model"].values())


# -----------------------------------------------------------------------------
# exact resume and atomic saves

@pytest.fixture(scope="module")
def fsdp_run(data_dir, shared):
    # helpers.EXACT's run, made once (read only)
    return exact_fsdp_run(shared, data_dir)


def test_bitwise_resume_under_fsdp(data_dir, fsdp_run, tmp_path):
    shutil.copytree(fsdp_run / "ckpt_0000003", tmp_path / "ckpt")
    out = run(*EXACT, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume", torchrun=TWO)
    assert "iter 4:" in out.stdout and "iter 3:" not in out.stdout
    assert losses(tmp_path) == {i: v for i, v in losses(fsdp_run).items() if i > 3}
    whole, parts = whole_checkpoint(fsdp_run / "ckpt"), whole_checkpoint(tmp_path / "ckpt")
    assert whole["model"].keys() == parts["model"].keys()
    assert all(torch.equal(whole["model"][k], parts["model"][k]) for k in whole["model"])
    moments = whole["optimizer"]  # {parameter name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}
    assert len(moments) > 0 and moments.keys() == parts["optimizer"].keys()
    assert all(torch.equal(moments[n][k], parts["optimizer"][n][k]) for n in moments for k in moments[n])
    # the model sample.py and export.py read is the same, and it is the model that was trained
    read = load_checkpoint(str(tmp_path / "ckpt"))["model"]
    assert all(torch.equal(read[k], whole["model"][k]) for k in read)


@pytest.mark.kills
def test_sigkill_between_the_renames_of_a_sharded_save_keeps_the_previous_one(data_dir, fsdp_run, tmp_path):
    # a config that hangs the save of step 6 after ckpt/ stepped aside as ckpt.old/ and before ckpt.tmp/
    # took its name: the one moment when no folder is called ckpt
    hang = tmp_path / "hang_between_renames.py"
    hang.write_text(
        "import os as _os, time as _time\n"
        "_replace = _os.replace\n"
        "def _hang(src, dst):\n"
        "    if str(src).endswith('ckpt.tmp') and _os.path.isdir(str(dst) + '.old'):\n"
        "        print('BETWEEN RENAMES', flush=True)\n"
        "        _time.sleep(600)\n"
        "    return _replace(src, dst)\n"
        "_os.replace = _hang\n"
    )
    out = tmp_path / "out"
    proc = start(*EXACT, f"--data_dir={data_dir}", f"--out_dir={out}", str(hang), torchrun=TWO)
    wait_for(proc, "BETWEEN RENAMES", timeout=240)
    kill(proc)  # the launcher and its workers: a worker left asleep would rename files here later
    assert not (out / "ckpt").exists() and (out / "ckpt.tmp" / "state.pt").exists()
    assert find_checkpoint(str(out / "ckpt.pt")) == str(out / "ckpt.old")
    assert load_checkpoint(str(out / "ckpt.old"), weights=False)["iter_num"] == 3
    # the same command again continues from step 3, and ends where the run that was never killed did
    run(*EXACT, f"--data_dir={data_dir}", f"--out_dir={out}", "--init_from=auto", torchrun=TWO)
    assert losses(out) == losses(fsdp_run)
    assert sorted(os.listdir(out)) == ["ckpt", "ckpt_best", "metrics.jsonl"]
    a, b = load_checkpoint(str(out / "ckpt"))["model"], load_checkpoint(str(fsdp_run / "ckpt"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.kills
def test_sigkill_at_random_moments_of_sharded_saves_loses_nothing(data_dir, fsdp_run, tmp_path):
    # a save at every step, so that kills often land in one; evaluations change nothing in training
    args = [*EXACT, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=1", "--keep_last_n=2"]
    rng = random.Random(0)
    for attempt in range(3):
        proc = start(*args, "--init_from=auto", torchrun=TWO)
        wait_for(proc, "saved ", timeout=240)
        time.sleep(rng.uniform(0.0, 0.3))
        kill(proc)
    run(*args, "--init_from=auto", torchrun=TWO)
    assert losses(tmp_path) == losses(fsdp_run)
    a, b = load_checkpoint(str(tmp_path / "ckpt"))["model"], load_checkpoint(str(fsdp_run / "ckpt"))["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    # no leftovers (ckpt.tmp, ckpt.old); a kill between step 9's save and the pruning of step 7's leaves that one
    names = sorted(os.listdir(tmp_path))
    steps = [name for name in names if name.startswith("ckpt_0")]
    assert names == ["ckpt", *steps, "ckpt_best", "metrics.jsonl"] and steps[-2:] == ["ckpt_0000008", "ckpt_0000009"]
    assert steps[:-2] in ([], ["ckpt_0000007"]), names


# -----------------------------------------------------------------------------
# layouts: two nodes, one process, compile and the kernels


def test_fsdp_on_two_nodes_whose_out_dir_is_not_shared_is_refused_before_its_first_save(data_dir, tmp_path):
    # Both nodes are on this machine, so each is given an out_dir of its own: they stand for each node's local
    # disk, where rank 1's shards would stay out of the checkpoint the master publishes. Refused at start, in one
    # line on both nodes, before any step is trained or saved.
    nodes = two_nodes(*TINY, f"--data_dir={data_dir}", "--max_iters=6", "--eval_interval=2",
                      "--gradient_accumulation_steps=2", "--fsdp=True",
                      node_args=[(f"--out_dir={tmp_path / f'node{node}'}",) for node in (0, 1)])
    assert all(node.returncode != 0 for node in nodes), nodes
    for node in nodes:
        said = [text for text in node.stderr.splitlines() if "train.py: " in text]  # torchrun's "[rank1]: " before
        assert len(said) == 1 and re.fullmatch(r"\[rank[01]\]: train.py: out_dir=\S+/node[01] is not shared: rank 1 "
                                               r"\(node [01], host [^)]+\) cannot see the files rank 0 writes there, "
                                               r".* put out_dir on storage every node mounts \(.*\)", said[0]), said
    for node in (0, 1):  # nothing trained, nothing saved, the probe removed (rank 1 made no out_dir)
        out = tmp_path / f"node{node}"
        assert not out.exists() or [p.name for p in out.iterdir() if p.name != ".lock"] == [], node


def test_fsdp_in_one_process_compiled_with_the_triton_kernels_matches_plain(data_dir, tmp_path):
    # one process: FSDP over a group of one (what CPU offload of a model too big for one GPU needs)
    # SGD: the weights differ by the two ops' rounding, which AdamW would amplify up to lr / eps where a gradient
    # is below eps (measured 7.8e-6 here with AdamW; see test_train's test_gradient_accumulation_matches_...)
    args = [*TINY, f"--data_dir={data_dir}", "--max_iters=2", "--block_size=16", "--batch_size=1",
            "--eval_interval=2", "--eval_iters=1", "--optimizer=sgd"]
    counter = kernel_counter(tmp_path)
    out = run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--fsdp=True", "--compile=True", "--use_kernels=True",
              counter, env={"TRITON_INTERPRET": "1"})
    assert_every_kernel_ran(out.stdout)  # the fused ops ran (the plain ones would give the same losses)
    assert_no_kernel_ran(run(*args, f"--out_dir={tmp_path / 'plain'}", "--use_kernels=False", counter).stdout)
    fsdp, plain = losses(tmp_path / "fsdp"), losses(tmp_path / "plain")
    assert fsdp.keys() == plain.keys() == {1, 2} and all(abs(fsdp[i] - plain[i]) < 1e-5 for i in fsdp)
    fused = load_checkpoint(str(tmp_path / "fsdp" / "ckpt"))
    a, b = fused["model"], weights(tmp_path / "plain")
    assert a.keys() == b.keys()
    assert_weights_close(a, b)
    assert fused["model_args"]["use_kernels"] is True


def test_fsdp_with_batch_size_auto_evaluates_where_a_process_has_no_share_left(data_dir, tmp_path):
    # 'auto' takes a micro-batch past the one an evaluation's sequences were counted by, and a process's last share
    # can be empty: under FSDP it skipped that forward, and the all-gathers the other process waited in (a hang until
    # dist_timeout). It now computes one with no targets: the losses of the same sequences split as given, to rounding
    args = [*TINY, f"--data_dir={data_dir}", "--fsdp=True", "--gradient_accumulation_steps=8", "--memory_budget=4.0",
            "--eval_iters=1", "--max_iters=2", "--eval_interval=2", "--dist_timeout=60"]
    out = run(*args, "--batch_size=auto", f"--out_dir={tmp_path / 'auto'}", torchrun=TWO).stdout
    micro = int(re.search(r"batch_size='auto': micro-batch (\d+)", out)[1])
    assert micro > 4  # past the --batch_size an evaluation's sequences were counted by (the case)
    run(*args, f"--out_dir={tmp_path / 'given'}", torchrun=TWO)
    auto, given = losses(tmp_path / "auto", "val_loss"), losses(tmp_path / "given", "val_loss")
    assert auto.keys() == given.keys() == {0, 2}
    assert all(abs(auto[i] - given[i]) <= 1e-4 * given[i] for i in given), (auto, given)


@pytest.mark.parametrize("args,message", [
    (["--dtype=float16"], "fsdp=True does not work with dtype='float16'"),
    (["--optimizer=muon"], "optimizer='muon' orthogonalizes whole matrices, and fsdp=True splits them"),
    (["--fsdp_cpu_offload=True"], "fsdp_cpu_offload=True moves FSDP's shards between a GPU and CPU memory"),
])
def test_fsdp_refusals_are_one_line(data_dir, tmp_path, args, message):
    # train.py's checks, in process (helpers.train_refusal; test_parallel.py's first refusal is train.py's line)
    assert message in train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--fsdp=True", *args)


# -----------------------------------------------------------------------------
# an imported model and LoRA under FSDP; sample.py and export.py read the shards


def read_folder(folder):
    from safetensors.torch import load_file
    return {name: t for f in sorted(folder.glob("*.safetensors")) for name, t in load_file(f).items()}


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the tiny Hugging Face folder needs transformers")
def test_fsdp_fine_tunes_an_imported_model_and_sample_and_export_read_its_shards(pretrained, tmp_path):
    folder, data = pretrained
    args = [*FINETUNE, f"--data_dir={data}", f"--init_from={folder}", "--max_iters=4", "--eval_interval=4",
            "--gradient_accumulation_steps=2", "--dropout=0.0"]
    run(*args, f"--out_dir={tmp_path / 'one'}")
    run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--fsdp=True", master_reads(tmp_path / "reads.py"), torchrun=TWO)
    assert_close_losses(losses(tmp_path / "fsdp"), losses(tmp_path / "one"), range(1, 5))
    sharded = load_checkpoint(str(tmp_path / "fsdp" / "ckpt"))
    assert sharded["pretrained"] == str(folder) and sharded["model_args"]["family"] == "qwen3"
    one = weights(tmp_path / "one")
    assert sharded["model"].keys() == one.keys()
    assert all(torch.allclose(sharded["model"][k], one[k], atol=1e-5) for k in one)
    # the same checkpoint as one file: sample.py and export.py give the same output from either
    (tmp_path / "file").mkdir()
    torch.save(sharded, tmp_path / "file" / "ckpt.pt")
    outputs = []
    for run_dir in (tmp_path / "fsdp", tmp_path / "file"):
        done = script("sample.py", f"--out_dir={run_dir}", "--start=def ", "--num_samples=1", "--max_new_tokens=16",
                      "--temperature=0", "--device=cpu")
        assert done.returncode == 0, done.stderr
        exported = script("export.py", f"--out_dir={run_dir}", f"--to={run_dir}-hf")
        assert exported.returncode == 0, exported.stderr
        outputs.append((done.stdout, read_folder(tmp_path / f"{run_dir.name}-hf")))
    (sample_a, hf_a), (sample_b, hf_b) = outputs
    assert sample_a == sample_b and sample_a.startswith("def ")
    assert hf_a.keys() == hf_b.keys() and all(torch.equal(hf_a[k], hf_b[k]) for k in hf_a)


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the tiny Hugging Face folder needs transformers")
def test_lora_under_fsdp_matches_one_process_and_saves_the_adapters_alone(pretrained, tmp_path):
    folder, data = pretrained
    args = [*LORA, f"--data_dir={data}", f"--init_from={folder}", "--max_iters=4", "--eval_interval=4",
            "--gradient_accumulation_steps=2", "--dropout=0.0"]
    run(*args, f"--out_dir={tmp_path / 'one'}")
    # the folder's weights read by the master alone (the other process cannot), each process given its shards
    run(*args, f"--out_dir={tmp_path / 'fsdp'}", "--fsdp=True", master_reads(tmp_path / "reads.py"), torchrun=TWO)
    assert_close_losses(losses(tmp_path / "fsdp"), losses(tmp_path / "one"), range(1, 5))
    adapters, one = load_checkpoint(str(tmp_path / "fsdp" / "ckpt"))["model"], weights(tmp_path / "one")
    assert adapters.keys() == one.keys() and all(".lora." in name for name in adapters)
    assert all(torch.allclose(adapters[k], one[k], atol=1e-5) for k in one)
    done = script("export.py", f"--out_dir={tmp_path / 'fsdp'}", f"--to={tmp_path / 'peft'}", "--adapter")
    assert done.returncode == 0 and (tmp_path / "peft" / "adapter_model.safetensors").exists(), done.stderr
    if importlib.util.find_spec("torchao") is not None:  # 4-bit tensors do not shard: refused in one line
        out = run(*args, f"--out_dir={tmp_path / 'nf4'}", "--fsdp=True", "--lora_base_dtype=nf4", check=False)
        assert out.returncode != 0 and "lora_base_dtype='nf4' cannot be sharded by fsdp=True" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
