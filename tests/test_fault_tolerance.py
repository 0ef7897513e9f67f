"""Killed, preempted, NaN-struck or fed bad files, training loses nothing and changes nothing."""

import json
import os
import pickle
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from helpers import (CPU_ENV, EXACT, ROOT, TINY, exact_fsdp_run, kill_marked, losses, marked, new_python, on_cpu,
                     poisoned_config, run, script, torchrun_command, train_refusal, two_nodes, weights)

COMMON = [*TINY, "--eval_interval=3", "--dropout=0.1"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def start(*args, torchrun=None):
    # train.py started in a new Python in a session of its own, its output (stdout and stderr together) read as it
    # goes: alone, or under torchrun with these arguments, as users run it
    env = {**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "train.py"] if torchrun is None else torchrun_command([*torchrun, "train.py"])
    return subprocess.Popen([*command, *on_cpu(args)], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def kill(proc):
    # SIGKILL a process started by start() and everything it started: its group, and torchrun's workers too,
    # which run in sessions of their own and would live on (found by the mark every process of this test
    # carries: helpers.marked); none may survive
    os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()
    kill_marked()
    assert not marked(), marked()
    return code


def wait_for(proc, text, timeout=120):
    # read the process's output until a line contains text (a str), or passes it (a function of the line)
    seen = []
    deadline = time.time() + timeout
    for line in proc.stdout:
        seen.append(line)
        if text(line) if callable(text) else text in line:
            return "".join(seen)
        assert time.time() < deadline, "".join(seen)
    raise AssertionError(f"{text!r} never printed:\n{''.join(seen)}")


def at_or_past(step):
    # a log line of step `step` or of a later one ("iter N:" with N >= step)
    def logged(line):
        found = re.match(r"iter (\d+):", line)
        return found is not None and int(found[1]) >= step
    return logged


def assert_same_optimizer_state(a, b):
    assert len(a["more_optimizers"]) == len(b["more_optimizers"])
    for sa, sb in zip([a["optimizer"], *a["more_optimizers"]], [b["optimizer"], *b["more_optimizers"]]):
        sa, sb = sa["state"], sb["state"]  # every optimizer's moments or momentum, bit for bit
        assert sa.keys() == sb.keys() and len(sa) > 0
        assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


@pytest.mark.slow  # the quick tier's exact resume: test_train.py's, in the middle of an epoch, dropout on
@pytest.mark.parametrize("optimizer,stop_at", [("adamw", 5), ("muon", 5), ("adamw", 1), ("adamw", 9), ("muon", 1),
                                               ("adam", 5), ("sgd", 5)])
def test_bitwise_resume_one_process(data_dir, tmp_path, optimizer, stop_at, shared):
    args = [*COMMON, f"--data_dir={data_dir}", f"--optimizer={optimizer}", "--lr_schedule=wsd"]
    # the uninterrupted run, the same for every stop_at: made once, only read
    uninterrupted = shared(f"whole_{optimizer}", lambda out: run(*args, f"--out_dir={out}", "--max_iters=10"))
    run(*args, f"--out_dir={tmp_path / 'parts'}", f"--max_iters={stop_at}")
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=10", "--init_from=resume")
    assert losses(uninterrupted) == losses(tmp_path / "parts")
    assert_same_weights(weights(uninterrupted), weights(tmp_path / "parts"))
    whole = torch.load(uninterrupted / "ckpt.pt", weights_only=True)
    parts = torch.load(tmp_path / "parts" / "ckpt.pt", weights_only=True)
    assert_same_optimizer_state(whole, parts)
    assert len(whole["more_optimizers"]) == (optimizer == "muon")  # Muon's beside AdamW
    evals = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()
             if "val_loss" in line]
    assert evals[-1]["val_loss"] < evals[0]["val_loss"] - 0.1  # and every optimizer trains


READ_RESUME = """
import sys
import torch
from torch.utils._pytree import tree_leaves
from lib import start
from lib.checkpoint import find_checkpoint
from lib.memory import proc_kib
out, mapped = sys.argv[1], sys.argv[2] == "mapped"
before = proc_kib("RssAnon")
_, checkpoint = start.starting_point(out, "resume", find_checkpoint(out + "/ckpt.pt"), mapped)
grown = proc_kib("RssAnon") - before
spans = [[int(a, 16) for a in line.split()[0].split("-")] for line in open("/proc/self/maps") if "ckpt.pt" in line]
inside = [t.dim() for t in tree_leaves(checkpoint) if isinstance(t, torch.Tensor) and t.numel() and
          any(a <= t.data_ptr() < b for a, b in spans)]  # the tensors the file's mapping holds, by their dims
print(grown, checkpoint["iter_num"], float(checkpoint["optimizer"]["state"][0]["exp_avg"].sum()), len(inside) > 0,
      0 in inside)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is Linux's")
def test_a_mapped_resume_holds_no_copy_of_its_checkpoint_of_its_own(data_dir, tmp_path):
    # under torchrun on GPUs (train.py: mapped) every process of a node reads ckpt.pt: mapped, it is in the page
    # cache once for all of them, where each held a copy of its own (a 3B model's weights and moments: 36 GB each)
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--n_layer=4", "--n_embd=512", "--n_head=8",
        "--max_iters=1", "--eval_interval=1", "--eval_iters=1")
    size_kib = os.path.getsize(tmp_path / "ckpt.pt") / 1024  # ~150 MB: weights and Adam's two moments
    read = {how: new_python("-c", READ_RESUME, tmp_path, how).stdout.split() for how in ("mapped", "read")}
    assert read["mapped"][1:3] == read["read"][1:3] == ["1", read["read"][2]]  # the same checkpoint either way
    assert int(read["read"][0]) > 0.9 * size_kib and int(read["mapped"][0]) < 0.1 * size_kib, (read, size_kib)
    # no scalar stays mapped (Adam's step: an optimizer keeps it as it is on the CPU, or unfused; one tensor held
    # would keep the file mapped, and a replaced ckpt.pt's disk blocks held all run); the weights are mapped
    assert read["mapped"][3:] == ["True", "False"] and read["read"][3:] == ["False", "False"], read


def test_resuming_with_another_optimizer_is_refused(data_dir, tmp_path):
    run(*COMMON, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2", "--optimizer=muon")
    said = train_refusal(*COMMON, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4",
                         "--init_from=resume")  # train.py's checks, in process
    assert "was trained with optimizer='muon': resume with --optimizer=muon" in said


DDP = [*COMMON, "--gradient_accumulation_steps=2", "--max_iters=40"]


def whole_ddp(shared, data_dir):
    # 40 steps under DDP on 2 processes, never stopped: made once, only read
    return shared("whole_ddp", lambda out: run(*DDP, f"--data_dir={data_dir}", f"--out_dir={out}",
                                               torchrun=["--standalone", "--nproc_per_node=2"]))


@pytest.mark.slow
@pytest.mark.kills
def test_sigkill_at_random_moments_then_resume_gives_the_uninterrupted_weights(data_dir, tmp_path):
    args = [*COMMON, f"--data_dir={data_dir}", "--max_iters=300", "--eval_interval=5", "--log_interval=10"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    out = tmp_path / "killed"
    rng = random.Random(0)
    kills = 0
    for attempt in range(8):
        resume = "--init_from=resume" if (out / "ckpt.pt").exists() else "--init_from=scratch"
        proc = start(*args, f"--out_dir={out}", resume)
        if attempt < 3:  # three kills at random moments, then let it finish
            wait_for(proc, "iter ")  # training has begun (the start-up itself is not interesting)
            time.sleep(rng.uniform(0.0, 0.5))
            kills += kill(proc) == -signal.SIGKILL
            continue
        proc.communicate(timeout=300)
        assert proc.returncode == 0
        break
    assert kills == 3
    assert_same_weights(weights(tmp_path / "whole"), weights(out))
    assert losses(tmp_path / "whole") == losses(out)


@pytest.mark.slow
@pytest.mark.kills
def test_sigkill_during_checkpoint_write_keeps_the_previous_one(data_dir, tmp_path):
    # a config that makes the save at step 6 write half its bytes, then hang there
    slow = tmp_path / "slow_save.py"
    slow.write_text(
        "import io as _io, time as _time, torch as _torch\n"
        "_save = _torch.save\n"
        "def _half_then_hang(obj, f, *a, **k):\n"
        "    if obj['iter_num'] < 6:\n"
        "        return _save(obj, f, *a, **k)\n"
        "    buf = _io.BytesIO()\n"
        "    _save(obj, buf)\n"
        "    f.write(buf.getvalue()[: len(buf.getvalue()) // 2])\n"
        "    f.flush()\n"
        "    print('HALF WRITTEN', flush=True)\n"
        "    _time.sleep(600)\n"
        "_torch.save = _half_then_hang\n"
    )
    out = tmp_path / "out"
    proc = start(*COMMON, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=9", str(slow))
    wait_for(proc, "HALF WRITTEN")
    kill(proc)
    assert (out / "ckpt.pt.tmp").exists()  # the half-written file never took the name
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 3
    stale = [".write-test-12345.tmp", ".shared-0123456789abcdef"]  # the start's probes, of a run killed starting
    for name in stale:
        (out / name).write_text("0")
    run(*COMMON, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=9", "--init_from=resume")
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 9
    assert not any((out / name).exists() for name in ["ckpt.pt.tmp", *stale])  # swept by the next save


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.kills
def test_signal_finishes_the_step_saves_and_exits_zero(data_dir, tmp_path, sig):
    proc = start(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100000",
                 "--eval_interval=100000")
    wait_for(proc, "iter 3:")
    proc.send_signal(sig)
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, output
    step = int(re.search(rf"{sig.name}: saved step (\d+) in ", output)[1])  # the run's one line of it
    assert step >= 3 and torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == step
    assert max(losses(tmp_path)) == step  # the step was finished and logged


# a config file that sends this process SIGTERM (as a scheduler would) while the run starts: once out_dir is its own
SIGNALLED_STARTING = """import os as _os, signal as _signal
import lib.checkpoint as _ckpt
_check_room = _ckpt.check_room
def _signalled(*args, **kwargs):
    _os.kill(_os.getpid(), _signal.SIGTERM)
    return _check_room(*args, **kwargs)
_ckpt.check_room = _signalled
"""


@pytest.mark.slow
def test_a_signal_while_the_run_starts_stops_it_there_and_keeps_out_dir_as_it_was(data_dir, tmp_path):
    # the run starts on (a resume may read a large checkpoint), then stops at its first step's evaluation, status 0
    # (SIGTERM's own default had ended the process, status -15, without a word): nothing trained, nothing saved, so
    # the command put right starts there anew. eval_only stopped has no result: status 1, in one line
    (tmp_path / "signalled.py").write_text(SIGNALLED_STARTING)
    args = on_cpu([*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=4"])
    said = f"SIGTERM: stopped before the run's first step; nothing saved, {tmp_path / 'out'} is as it was"
    done = new_python("train.py", *args, tmp_path / "signalled.py")
    assert done.returncode == 0 and said in done.stdout and not (tmp_path / "out" / "ckpt.pt").exists(), \
        done.stdout + done.stderr
    run(*args, "--n_layer=3")
    (tmp_path / "evaluating.py").write_text(SIGNALLED_EVALUATING)
    done = new_python("train.py", *args, "--n_layer=3", "--eval_only=True", "--init_from=resume",
                      tmp_path / "evaluating.py", env={"SIGNAL_AT_BATCH": "1"})
    assert done.returncode == 1 and done.stderr.strip() == \
        "train.py: SIGTERM stopped the evaluation before its end; eval_only wrote nothing", done.stdout + done.stderr


@pytest.mark.slow
@pytest.mark.kills
def test_a_stop_at_an_evaluation_step_evaluates_on_resume(data_dir, tmp_path):
    # eval_interval=1: every stop lands on a step whose evaluation has not run yet
    args = [*TINY, f"--data_dir={data_dir}", "--eval_interval=1", "--eval_iters=1", "--max_iters=60"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    proc = start(*args, f"--out_dir={tmp_path / 'parts'}")
    wait_for(proc, "iter 3:")
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0]
    step = int(re.search(r"SIGTERM: saved step (\d+) in ", output)[1])
    assert step < 60
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--init_from=resume")

    def evals(out_dir):
        lines = (tmp_path / out_dir / "metrics.jsonl").read_text().splitlines()
        return {r["iter"]: r["val_loss"] for r in map(json.loads, lines) if "val_loss" in r}
    assert evals("whole") == evals("parts") and len(evals("parts")) == 61


@pytest.mark.slow
@pytest.mark.kills
@pytest.mark.parametrize("launcher", ["torch.distributed.run", "lib.launch"])
def test_sigterm_under_torchrun_every_rank_stops_at_the_same_step(data_dir, tmp_path, launcher):
    # torchrun's plain launch, as a scheduler's job runs it: its workers new Pythons in sessions of their own,
    # which only torchrun's forwarding of the signal reaches; and lib.launch, torchrun as config/slurm.sbatch runs
    # it, which says the same in one line
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100000", "--eval_interval=100000",
            "--gradient_accumulation_steps=2"]
    proc = subprocess.Popen([sys.executable, "-m", launcher, "--standalone", "--nproc_per_node=2", "train.py",
                             *on_cpu(args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1"})
    wait_for(proc, "iter 3:")
    os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler does: the launcher and its workers
    output = proc.communicate(timeout=120)[0]
    stops = re.findall(r"SIGTERM: saved step (\d+) in ", output)
    assert len(stops) == 1, output  # one line for the run, the master's
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == int(stops[0]) and len(saved["rng"]) == 2  # both ranks' state, of that step
    assert not torch.equal(saved["rng"][0]["cpu"], saved["rng"][1]["cpu"])  # each replica its own dropout masks
    # the workers exit cleanly: no traceback passes through the project's code, and the one report is torchrun's
    # own of the signal it got (its agent can chain an error of its own to it, when the signal lands inside its
    # metrics wrapper: torch's race, seen once here, not the workers')
    assert not re.search(rf'File "{re.escape(str(ROOT))}/(?!\.venv/)', output), output
    if launcher == "lib.launch":
        assert proc.returncode == 0 and "Traceback" not in output, output
        assert output.rstrip().endswith("torchrun: SIGTERM, its workers stopped"), output
    else:
        assert output.count("SignalException: Process") == 1, output


# a config file by which rank 0 alone gets SIGTERM as it reads an evaluation's SIGNAL_AT_BATCH-th batch (6: in step
# 2's evaluation, of 2 train and 2 val batches each)
SIGNALLED_EVALUATING = """import os as _os, signal as _signal
import lib.data as _data
_read, _evaluation = [], _data.Batches.evaluation
def _counted(self, split, index):
    _read.append(split)
    if len(_read) == int(_os.environ.get("SIGNAL_AT_BATCH", 6)) and _os.environ.get("RANK", "0") == "0":
        _os.kill(_os.getpid(), _signal.SIGTERM)
    return _evaluation(self, split, index)
_data.Batches.evaluation = _counted
"""


@pytest.mark.slow
def test_a_signal_to_one_process_during_an_evaluation_stops_every_process_there(data_dir, tmp_path):
    # the processes agree at each batch of an evaluation whether to stop (one stopping alone, the other waited at
    # the next collective until dist_timeout): the step is saved unevaluated, status 0
    (tmp_path / "signalled.py").write_text(SIGNALLED_EVALUATING)
    done = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=6", "--eval_interval=2",
               "--gradient_accumulation_steps=2", "--dist_timeout=60", str(tmp_path / "signalled.py"),
               torchrun=["--standalone", "--nproc_per_node=2"], check=False)
    assert done.returncode == 0 and "SIGTERM: saved step 2 in " in done.stdout, done.stdout + done.stderr
    saved = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert (saved["iter_num"], saved["evaluated"]) == (2, False)


@pytest.mark.slow  # two torchruns
@pytest.mark.kills
def test_sigterm_to_one_nodes_lib_launch_ends_the_other_node_too(data_dir, tmp_path):
    # one node's torchrun stopped alone (SIGTERM to it, which passes it on): every worker saves and stops, and the
    # other node's torchrun, at its exit barrier, is met there (it waited 300 s, then ended in a traceback)
    from helpers import free_port
    port, env = free_port(), {**os.environ, **CPU_ENV, "PYTHONUNBUFFERED": "1"}
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100000", "--eval_interval=100000",
            "--gradient_accumulation_steps=2"]
    nodes = [subprocess.Popen([sys.executable, "-m", "lib.launch", "--nnodes=2", f"--node_rank={node}",
                               "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
                               "--rdzv_id=one_signalled", "train.py", *on_cpu(args)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for node in (0, 1)]
    try:
        wait_for(nodes[0], "iter 3:")
        nodes[1].send_signal(signal.SIGTERM)  # its torchrun alone
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert outputs[1].rstrip().endswith("torchrun: SIGTERM, its workers stopped"), outputs[1]
    assert "a signal to another process: saved step" in outputs[0] and "Traceback" not in outputs[0], outputs[0]


@pytest.mark.slow
@pytest.mark.parametrize("mistake, said", [
    ([], "gradient_accumulation_steps=1 must be a multiple of the 2"),  # TINY's one micro-step, for 2 processes
    (["--gradient_accumulation_steps=2", "--data_dir=nowhere"], "no nowhere/train.bin"),  # once the group has formed
    # a folder's weights, which the master alone reads: the other process stops with its line, not killed waiting
    (["--gradient_accumulation_steps=2", "--init_from=NAN"], "up_proj.weight in {nan}/model.safetensors holds a NaN"),
])
def test_workers_that_refuse_end_lib_launch_in_one_line_after_theirs(data_dir, tmp_path, mistake, said):
    # torchrun's own report of failed workers is a traceback of its own after their lines; lib.launch's is a line.
    # Each worker exits 1 after its line, never aborted by gloo's threads in the interpreter's teardown ("terminate
    # called without an active exception", 1 run in 4 of the second mistake before the teardown was skipped)
    if "--init_from=NAN" in mistake:
        from lib.hf import save_pretrained
        from model import GPT, GPTConfig
        model = GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
        with torch.no_grad():
            model.blocks[1].mlp.up.weight[0, 0] = float("nan")
        save_pretrained(model, tmp_path / "nan")
        mistake, said = [*mistake[:-1], f"--init_from={tmp_path / 'nan'}"], said.format(nan=tmp_path / "nan")
    out_dir = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "lib.launch", "--standalone", "--nproc_per_node=2", "train.py",
                           *on_cpu([*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", *mistake])],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **CPU_ENV}, timeout=300)
    refusals = [line for line in done.stderr.splitlines() if "train.py: " in line]
    assert done.returncode == 1 and len(refusals) == 2, done.stderr
    assert all(said in line for line in refusals), refusals
    assert "Traceback" not in done.stderr and "terminate called" not in done.stderr, done.stderr
    assert re.search(r"^torchrun: train\.py's rank [01] \(and 1 more\) ended with exit code 1; its own lines above "
                     r"say why$", done.stderr, re.M), done.stderr
    assert not out_dir.exists()  # the folder the refused run made is let go, as at any exit (atexit's)


@pytest.mark.slow
def test_ddp_replicas_whose_weights_part_are_stopped_at_the_first_save(data_dir, tmp_path):
    # an edit that draws random numbers after the gradients' all-reduce (noise on the gradients before the step):
    # each replica draws from a dropout stream of its own, so their weights part, and a checkpoint would keep the
    # master's alone with nothing said. Every process stops at the first save, in one line, and nothing is written
    config = poisoned_config(tmp_path / "noisy.py", (
        "def _noisy(self, *args, **kwargs):\n"
        "    for p in [p for group in self.param_groups for p in group['params'] if p.grad is not None]:\n"
        "        p.grad.add_(_torch.randn_like(p.grad), alpha=0.01)\n"
        "    return _step(self, *args, **kwargs)\n"
        "_torch.optim.AdamW.step = _noisy\n"))
    done = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=4", "--eval_interval=2",
               "--gradient_accumulation_steps=2", config, torchrun=["--standalone", "--nproc_per_node=2"],
               check=False)
    said = [line for line in done.stderr.splitlines() if "train.py: the weights of the DDP replicas differ at step 2: "
            "something in the update is not the same in every replica" in line]
    assert done.returncode != 0 and len(said) == 2, done.stderr[-3000:]  # (one line each, as [rank0]: and [rank1]:)
    assert not (tmp_path / "out" / "ckpt.pt").exists()


def nan_config(tmp_path, from_call):
    # a config file that turns the training loss to NaN from the from_call-th loss computed on
    return poisoned_config(tmp_path / f"nan_from_{from_call}.py", (
        "def _nan(x, w, t, ignore_index=-1):\n"
        "    _calls[0] += not _is_fake(x)\n"
        f"    return _loss(x, w, t, ignore_index) * (float('nan') if _calls[0] in {from_call} else 1.0)\n"
        "_m.linear_cross_entropy = _nan\n"))


def test_non_finite_loss_skips_the_update(data_dir, tmp_path):
    # evaluation computes its losses in GPT.loss_and_accuracy, never through linear_cross_entropy:
    # the 1st call is step 1's training loss
    config = nan_config(tmp_path, "(1,)")
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_iters=1", "--max_iters=5",
              "--eval_interval=5", config)
    assert "iter 1: skipped, loss nan" in out.stdout
    def strict(word):  # standard JSON has no NaN: what other readers than Python's (jq, node) refuse
        raise ValueError(f"{word} is not JSON")
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert [(r["iter"], r["loss"]) for r in records if r.get("skipped")] == [(1, None)]  # null: not a number
    from plot import read_run
    assert 1 not in [r["iter"] for r in read_run(tmp_path)[0]]  # a gap in the curve
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 5
    steps = {s["step"].item() for s in state["optimizer"]["state"].values()}
    assert steps == {4.0}  # 5 steps, one of them applied to nothing, the optimizer's moments included
    assert all(torch.isfinite(p).all() for p in state["model"].values())


def test_a_float16_scalers_overflow_is_no_divergence(data_dir, tmp_path):
    # float16's gradient scaler starting high (as it climbs back every 2,000 steps): its first updates' gradients
    # overflow, which it skips while halving its scale. No step counts as skipped, the evaluated checkpoints are
    # kept and the last one saved. The config file replaces torch's GradScaler for the run, and puts it back at its
    # end (an exit function: the run's process is the test's)
    (tmp_path / "high_scale.py").write_text(
        "import atexit as _atexit\n"
        "import torch as _torch\n"
        "_plain = _torch.amp.GradScaler\n"
        "class _High(_plain):\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        super().__init__(*args, **{**kwargs, 'init_scale': 2.0 ** 24})\n"
        "def _put_back():\n"
        "    _torch.amp.GradScaler = _plain\n"
        "_torch.amp.GradScaler = _High\n"
        "_atexit.register(_put_back)\n")
    def train(out, *more):
        return run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / out}", "--dtype=float16", "--max_iters=6",
                   "--eval_interval=3", "--eval_iters=1", "--max_skipped_steps=1", str(tmp_path / "high_scale.py"),
                   *more, check=False)
    done = train("run")
    assert done.returncode == 0 and "skipped" not in done.stdout, done.stdout + done.stderr
    state = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 6 and state["scaler"]["scale"] < 2.0 ** 24  # it overflowed, and halved
    records = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "Infinity" not in records and "NaN" not in records
    # a resume goes on from the scale it saved (not from the high one again): as a run that was not stopped
    assert train("run", "--max_iters=9", "--init_from=resume").returncode == 0
    assert train("straight", "--max_iters=9").returncode == 0
    resumed, straight = (torch.load(tmp_path / run / "ckpt.pt", weights_only=True) for run in ("run", "straight"))
    assert resumed["scaler"] == straight["scaler"]
    assert all(torch.equal(resumed["model"][k], straight["model"][k]) for k in straight["model"])
    assert torch.amp.GradScaler is torch.amp.grad_scaler.GradScaler  # put back: torch's own

@pytest.mark.slow
def test_too_many_non_finite_steps_stop_and_keep_the_last_good_checkpoint(data_dir, tmp_path):
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=4")
    before = (tmp_path / "ckpt.pt").read_bytes()
    config = nan_config(tmp_path, "range(1, 10**9)")  # NaN on every step after resuming (no eval there)
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=20", "--eval_interval=4",
              "--eval_iters=1", "--max_skipped_steps=3", "--init_from=resume", config, check=False)
    assert out.returncode != 0
    assert "3 updates in a row had a non-finite loss or gradient" in out.stderr
    assert (tmp_path / "ckpt.pt").read_bytes() == before


def test_keep_last_n_and_best_checkpoint(data_dir, tmp_path):
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=10", "--eval_interval=2",
        "--keep_last_n=2")
    names = sorted(p.name for p in tmp_path.glob("ckpt*.pt"))
    assert names == ["ckpt.pt", "ckpt_0000008.pt", "ckpt_0000010.pt", "ckpt_best.pt"]
    newest = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    best = torch.load(tmp_path / "ckpt_best.pt", weights_only=True)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    best_eval = min(evals, key=lambda r: r["val_loss"])
    assert newest["iter_num"] == 10 and best["iter_num"] == best_eval["iter"]
    assert best["best_val_loss"] == best_eval["val_loss"]


def test_early_stopping(data_dir, tmp_path):
    # learning_rate=0: the val loss never improves after the first evaluation
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100", "--eval_interval=2",
              "--learning_rate=0", "--min_lr=0", "--early_stop_patience=2")
    assert "early stop" in out.stdout
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 4
    before = (tmp_path / "ckpt.pt").read_bytes()
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100", "--eval_interval=2",
              "--learning_rate=0", "--min_lr=0", "--early_stop_patience=2", "--init_from=auto")  # a restart
    assert "stopped early at step 4" in out.stdout and (tmp_path / "ckpt.pt").read_bytes() == before


def test_early_stop_min_delta(data_dir, tmp_path):
    # val loss falls at every evaluation here, but never by 10: only the first evaluation counts as better
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100", "--eval_interval=2",
              "--early_stop_patience=2", "--early_stop_min_delta=10.0")
    assert "early stop" in out.stdout
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert state["iter_num"] == 4 and evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert state["best_val_loss"] == evals[0]["val_loss"]


def test_a_resume_that_measures_the_val_loss_otherwise_starts_its_best_anew(data_dir, tmp_path):
    # the checkpoint's best val loss was over windows of 32 tokens; a resume at block_size=16 logs another measure,
    # which may not count as no better than it (early_stop_min_delta=10: nothing after the first evaluation is better)
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=2")
    again = [f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=20", "--eval_interval=2",
             "--early_stop_patience=1", "--early_stop_min_delta=10.0", "--init_from=resume"]
    # eval_only, which writes no ckpt_best and trains on no batches, says neither
    out = run(*TINY, *again, "--block_size=16", "--eval_only=True")
    assert "resuming" in out.stdout and "measured otherwise" not in out.stdout and "warning" not in out.stdout
    out = run(*TINY, *again, "--block_size=16")
    assert "the val loss is measured otherwise" in out.stdout and "early stop" in out.stdout
    assert "warning: seed, sequences, block_size or the sequences of an update" in out.stdout
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "val_loss" in line]
    assert state["iter_num"] == 8 and state["best_val_loss"] == evals[-2]["val_loss"]  # step 6's: the new first
    out = run(*TINY, *again, "--block_size=16", "--max_iters=30", "--early_stop_patience=3")  # measured as before
    assert "measured otherwise" not in out.stdout


def test_a_resume_that_evaluates_other_val_windows_starts_its_best_anew(data_dir, tmp_path):
    # random windows: the val loss is the mean over the first eval_iters x batch_size x processes of them, and a
    # resume that reads more or fewer measures another sample, which ckpt_best and early stopping must not compare
    common = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*common, "--max_iters=4")
    out = run(*common, "--max_iters=6", "--eval_iters=3", "--init_from=resume")
    assert "the val loss is measured otherwise" in out.stdout
    assert "measured otherwise" not in run(*common, "--max_iters=8", "--eval_iters=3", "--init_from=resume").stdout


def test_val_measure_leaves_out_settings_that_play_no_part():
    # whole examples (sequences='examples', or eval_full over masks) are scored alike whatever eval_full, eval_stride
    # and doc_mask say: resuming with them changed must not start the best val loss anew (ckpt_best overwritten)
    from lib.data import val_measure
    c = dict(block_size=32, eval_full=False, eval_stride=-1, doc_mask=False, sequences="random")
    same = [({}, {"eval_stride": 8}, {}), ({"eval_full": True}, {"eval_full": True, "eval_stride": 16}, {}),
            ({"sequences": "examples"}, {"sequences": "examples", "eval_full": True, "doc_mask": True}, {}),
            ({"eval_full": True}, {"eval_full": True, "eval_stride": 4, "doc_mask": True}, {"masks": True})]
    for a, b, meta in same:
        assert val_measure({**c, **a}, meta) == val_measure({**c, **b}, meta), (a, b, meta)
    other = [({"eval_full": True}, {"eval_full": True, "eval_stride": 4}, {}), ({}, {"doc_mask": True}, {}),
             ({}, {"block_size": 16}, {}), ({}, {"eval_full": True}, {}), ({}, {"sequences": "examples"}, {})]
    for a, b, meta in other:
        assert val_measure({**c, **a}, meta) != val_measure({**c, **b}, meta), (a, b, meta)


class Boom:
    def __reduce__(self):
        return (os.system, (f"touch {Boom.marker}",))


def test_a_foreign_checkpoint_is_refused_in_one_line(data_dir, tmp_path):
    torch.save({"model": {}, "iter_num": 3}, tmp_path / "ckpt.pt")  # tensors and plain values, but not ours
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume")
    assert "is not a checkpoint of this train.py (it lacks best_val_loss, config," in said


def test_malicious_checkpoint_is_refused_and_runs_nothing(data_dir, tmp_path):
    Boom.marker = tmp_path / "pwned"
    (tmp_path / "ckpt.pt").write_bytes(pickle.dumps({"model": Boom()}))
    # train.py's checks, in process (helpers.train_refusal): the payload would write the marker here
    said = train_refusal(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--init_from=resume")
    assert "holds objects other than tensors and plain values; refusing to load it" in said
    assert not Boom.marker.exists()
    out = script("sample.py", f"--out_dir={tmp_path}")
    assert out.returncode != 0 and "refusing to load it" in out.stderr and not Boom.marker.exists()


def test_out_of_range_token_names_file_and_position(data_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("meta.json", "val.bin"):
        (bad / name).write_bytes((data_dir / name).read_bytes())
    ids = np.fromfile(data_dir / "train.bin", dtype=np.uint16)
    ids[1000:] = 200  # beyond the model's vocabulary: the data's ids padded to a multiple of 64, < 200
    ids.tofile(bad / "train.bin")
    said = train_refusal(*TINY, f"--data_dir={bad}", f"--out_dir={tmp_path / 'o'}")  # (one line: train_refusal)
    assert f"{bad}/train.bin holds token id 200 at position 1000, past meta.json's vocab_size" in said


def final_weights(out_dir):
    # the weights of a run's last checkpoint, a file or (FSDP) a sharded folder
    from lib.resume import read_sharded
    return read_sharded(str(out_dir / "ckpt")) if (out_dir / "ckpt").is_dir() else weights(out_dir)


@pytest.mark.slow
@pytest.mark.kills
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers to kill in /proc")
def test_torchrun_restarts_a_killed_worker_and_the_run_ends_as_if_never_killed(data_dir, tmp_path, shared):
    # kill -9 one worker (as the out-of-memory killer or a lost node does) at a random step, twice in the
    # run's life: torchrun restarts the group, which resumes from its last checkpoint (--init_from=auto). The
    # run ends with the losses and weights of the run never killed (the same settings but the two below, which
    # change no step), bit for bit: DDP's exact resume, twice, the second by a group started again already (every
    # rank's RNG and data position restored; test_bitwise_resume_one_process tries stops before, after and on
    # evaluations). Under FSDP a restart is the two-node test's below, and a kill at any moment of a sharded save
    # test_scale's test_sigkill_at_random_moments_of_sharded_saves_loses_nothing.
    # dist_timeout bounds how long a restarted group waits for its members: each a new Python under torchrun,
    # which can take seconds to start on a loaded machine (15 s once made a fourth failure of a slow start)
    args = [*DDP, f"--data_dir={data_dir}", "--init_from=auto", "--dist_timeout=60"]
    two = ["--standalone", "--nproc_per_node=2"]
    (tmp_path / "whole").symlink_to(whole_ddp(shared, data_dir))
    proc = start(*args, f"--out_dir={tmp_path / 'killed'}", torchrun=[*two, "--max-restarts=9"])
    rng = random.Random("ddp")
    output = ""
    for kill, step in enumerate(sorted(rng.sample(range(5, 36), 2))):
        if kill:  # the group torchrun started again: both its workers are up once its master says so (the
            # surviving worker may log a step or two before its peer's death reaches it)
            output += wait_for(proc, "process(es) on cpu")
        output += wait_for(proc, at_or_past(step))
        workers = sorted(pid for pid in marked() if pid != proc.pid)  # torchrun's, not torchrun
        assert len(workers) == 2, workers
        os.kill(rng.choice(workers), signal.SIGKILL)
    output += proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    # torchrun saw two failures (the killed worker's, or its peer's as the connection broke: whichever it
    # polled first) and started the group three times
    assert output.count("failed (exitcode: ") == 2 and output.count("process(es) on cpu") == 3, output[-3000:]
    assert losses(tmp_path / "whole") == losses(tmp_path / "killed")
    assert_same_weights(final_weights(tmp_path / "whole"), final_weights(tmp_path / "killed"))


def kill_the_other_node(out_dir, step, killed):
    # SIGKILL the worker of the node that does not hold rank 0 (of a two_nodes run, one worker a node) once the run
    # has logged step `step` (metrics.jsonl): among this test's processes (helpers.marked) that are not a torchrun,
    # the one whose pid is not the one holding out_dir's lock (files.py).
    # killed: the pid killed, or the error, for the test to read.
    try:
        deadline, metrics = time.time() + 120, out_dir / "metrics.jsonl"
        while not (metrics.exists() and f'"iter": {step},' in metrics.read_text()):
            assert time.time() < deadline, f"step {step} never logged"
            time.sleep(0.05)
        master = int((out_dir / ".lock").read_text().split("(pid ")[1].split(")")[0])
        workers = [pid for pid, command in marked().items() if "torch.distributed.run" not in command]
        assert len(workers) == 2 and master in workers, (workers, master)
        victim = next(pid for pid in workers if pid != master)
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
    except BaseException as e:
        killed.append(e)


# A config file that makes the step after the kill (kill_the_other_node's step) last 3 s more before its forward
# pass, as a large model's steps last seconds: the kill then finds the other node's worker computing,
# not in a collective, and that node's torchrun sees the new rendezvous round (a membership change, which it
# counts as no restart) before its worker sees its peer gone. Only the time changes, not what is computed.
SLOW_STEP = """
import time as _time
import lib.data as _data
_train = _data.Batches.train
def _slow(self, step, index):
    if step == {step}:
        _time.sleep(3)
    return _train(self, step, index)
_data.Batches.train = _slow
"""


@pytest.mark.slow
@pytest.mark.kills
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker to kill in /proc")
def test_a_worker_killed_on_one_of_two_nodes_restarts_both_and_the_run_ends_as_if_never_killed(data_dir, tmp_path,
                                                                                              shared):
    # Two nodes as two torchruns on this machine, meeting at a c10d rendezvous on 127.0.0.1 (docs/gpus.md),
    # one worker each; kill -9 of the worker on the node without rank 0, as the out-of-memory killer does. Each
    # torchrun counts its own restarts (rank 0's node, whose worker is stopped for the other's failure, counts
    # none), so the group's generation must come from the store they share (parallel.generation), or the new
    # workers never meet and both nodes fail. Under FSDP, whose restart after a kill only this test runs (DDP's is
    # the one-node test's above; what the nodes do is the same for both layouts).
    # the same run on one node, never killed: the session's exact FSDP run (helpers)
    whole = exact_fsdp_run(shared, data_dir)
    (tmp_path / "slow_step.py").write_text(SLOW_STEP.format(step=5))
    args = [*EXACT, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'killed'}", "--init_from=auto",
            "--dist_timeout=60", str(tmp_path / "slow_step.py")]
    killed = []
    killer = threading.Thread(target=kill_the_other_node, args=(tmp_path / "killed", 4, killed))
    killer.start()
    nodes = two_nodes(*args, torchrun=["--max-restarts=1"])
    killer.join()
    output = "".join(node.stdout + node.stderr for node in nodes)
    assert len(killed) == 1 and isinstance(killed[0], int), killed
    assert [node.returncode for node in nodes] == [0, 0], output[-4000:]
    assert output.count("process(es) on cpu") == 2, output[-4000:]  # the group began twice
    assert losses(whole) == losses(tmp_path / "killed")
    assert_same_weights(final_weights(whole), final_weights(tmp_path / "killed"))


def tmpfs_available():
    # a small filesystem of the test's own (a user namespace may mount one where the kernel allows it)
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_and_it_resumes_once_there_is_room(data_dir, tmp_path):
    args = [*COMMON, f"--data_dir={data_dir}", "--max_iters=9"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    size = (tmp_path / "whole" / "ckpt.pt").stat().st_size
    out = tmp_path / "disk" / "out"
    out.parent.mkdir()
    python = " ".join(map(shlex.quote, [sys.executable, "train.py", *on_cpu([*args, f"--out_dir={out}"])]))
    logs = f"> {tmp_path / 'full.out'} 2> {tmp_path / 'full.err'}"
    env = {**os.environ, **CPU_ENV}
    # room for the checkpoint of step 3 (ckpt.pt and ckpt_best.pt, each a file of its own), not for step 6's beside
    # them; then a bigger disk
    if tmpfs_available():
        script = (f"mount -t tmpfs -o size={size * 5 // 2 // 1024}k tmpfs {out.parent} && {python} {logs}; "
                  f"ls -a {out} > {tmp_path / 'listing'}; mount -o remount,size=16m {out.parent} && "
                  f"{python} --init_from=auto > {tmp_path / 'resumed.out'} && cp -r {out} {tmp_path / 'final'}")
        subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env, timeout=300, check=True)
    else:  # where no user namespace may mount one: ENOSPC from the file's write, half of step 6's written
        full = tmp_path / "full_disk.py"
        full.write_text("import errno as _errno, torch as _torch\n"
                        "_save = _torch.save\n"
                        "def _full(obj, f, *a, **k):\n"
                        "    if obj['iter_num'] < 6:\n"
                        "        return _save(obj, f, *a, **k)\n"
                        f"    f.write(bytes({size // 2}))\n"
                        "    raise OSError(_errno.ENOSPC, 'No space left on device')\n"
                        "_torch.save = _full\n")
        subprocess.run(f"{python} {full} {logs}; ls -a {out} > {tmp_path / 'listing'}", shell=True, cwd=ROOT,
                       env=env, timeout=300)
        run(*args, f"--out_dir={out}", "--init_from=auto")
        (tmp_path / "final").symlink_to(out)
    error = (tmp_path / "full.err").read_text().strip()
    assert len(error.splitlines()) == 1, error
    assert "could not write the checkpoint of step 6" in error and "No space left on device" in error
    assert f"{out}/ckpt.pt from step 3 is intact: make room" in error
    assert (tmp_path / "listing").read_text().split() == [".", "..", "ckpt.pt", "ckpt_best.pt", "metrics.jsonl"]
    assert torch.load(tmp_path / "final" / "ckpt.pt", weights_only=True)["iter_num"] == 9
    assert losses(tmp_path / "whole") == losses(tmp_path / "final")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "killed among its copies", "disk full"])
def test_a_first_save_that_dies_after_its_copies_leaves_a_run_that_resumes(data_dir, tmp_path, how):
    # The run's first save (step 3) makes its copies (ckpt_best, ckpt_0000003) from its finished tmp, then dies as the
    # tmp takes the name ckpt.pt: killed there (or between its two copies), the copies are that checkpoint and the
    # next start makes ckpt.pt of one, and the copies not made yet (the run resumes at step 3, whose save is not made
    # again); failing there (a full disk), it removes the copies with the tmp (the run begins again). Either way
    # --init_from=auto (torchrun's restarts) ends as the uninterrupted run, every copy of it there and the same
    args = [*COMMON, f"--data_dir={data_dir}", "--max_iters=9", "--keep_last_n=3"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    dies, at = tmp_path / "dies.py", "/ckpt_0000003.pt" if how == "killed among its copies" else "/ckpt.pt"
    dies.write_text("import errno as _errno, os as _os\n"
                    "_replace = _os.replace\n"
                    "def _dies(src, dst, *a, **k):\n"
                    f"    if str(dst).endswith({at!r}):\n"
                    + ("        raise OSError(_errno.ENOSPC, 'No space left on device')\n" if how == "disk full" else
                       "        _os._exit(9)\n") +
                    "    return _replace(src, dst, *a, **k)\n"
                    "_os.replace = _dies\n")
    out = tmp_path / "out"
    done = new_python("train.py", *on_cpu([*args, f"--out_dir={out}", str(dies)]))
    left = sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt"))
    if how == "killed":
        assert done.returncode == 9 and left == ["ckpt.pt.tmp", "ckpt_0000003.pt", "ckpt_best.pt"]
    elif how == "killed among its copies":
        assert done.returncode == 9 and left == ["ckpt.pt.tmp", "ckpt_0000003.pt.tmp", "ckpt_best.pt"]
    else:
        assert done.returncode == 1 and left == [] and "no earlier checkpoint was written" in done.stderr
    resumed = run(*args, f"--out_dir={out}", "--init_from=auto")
    assert ("resuming" in resumed.stdout) == (how != "disk full")
    assert losses(tmp_path / "whole") == losses(out)
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("ckpt"))
    assert names == sorted(p.name for p in (tmp_path / "whole").iterdir() if p.name.startswith("ckpt"))
    for name in names:
        assert_same_weights(weights(tmp_path / "whole", name), weights(out, name))


def test_a_run_that_ended_off_the_evaluation_interval_says_so_when_it_goes_on(data_dir, tmp_path):
    # max_iters=7 evaluates step 7, its last, which a run that went on past it never evaluates: counted for
    # ckpt_best and early stopping, it can make the run go on otherwise, which a resume with a later max_iters says
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=5"]
    run(*args, "--max_iters=7")
    said = "; step 7, its last, off eval_interval, was evaluated, and counts for ckpt_best and early stopping as it " \
           "would in no run that went on past it"
    assert said in run(*args, "--max_iters=10", "--init_from=resume").stdout
    assert said.replace("7", "10") not in run(*args, "--max_iters=12", "--init_from=resume").stdout  # (10: on it)


def test_a_resume_on_another_number_of_processes_under_dropout_says_its_masks_begin_anew(data_dir, tmp_path):
    # the checkpoint of a run on 2 processes (its random streams two), resumed on 1: dropout's masks come from the seed
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--dropout=0.1", "--eval_interval=2"]
    run(*args, "--max_iters=2")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    torch.save({**state, "rng": state["rng"] * 2, "world_size": 2}, tmp_path / "ckpt.pt")
    out = run(*args, "--max_iters=4", "--init_from=resume").stdout
    assert "note: dropout's masks are drawn from the seed again: the checkpoint's random streams are those of 2 " \
           "process(es) (tp_size=1), not of these 1 (tp_size=1)" in out, out
    assert "dropout's masks" not in run(*args, "--max_iters=6", "--init_from=resume").stdout  # (saved by 1 now)


def test_eval_only_evaluates_a_run_that_stopped_early(data_dir, tmp_path):
    # a run that stopped early has nothing left to train, but eval_only asks for its losses, not for training
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=100", "--eval_interval=2",
            "--learning_rate=0", "--min_lr=0", "--early_stop_patience=1"]
    run(*args)
    out = run(*args, "--init_from=resume", "--eval_only=True")
    assert re.search(r"step 2: train loss [\d.]+, val loss [\d.]+", out.stdout), out.stdout
    # and on a disk with no room left: it writes nothing, so the room a save needs is no reason to refuse it
    import shutil
    real = shutil.disk_usage
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=0))
        out = run(*args, "--init_from=resume", "--eval_only=True")
        assert "val loss" in out.stdout and "MB free" not in out.stdout, out.stdout
        refused = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'new'}", check=False)
        assert "0.0 MB free" in refused.stderr, refused.stderr  # (where a run would write)


def test_a_run_begun_in_float32_resumes_in_float16(data_dir, tmp_path):
    # its checkpoint's gradient scaler is an empty state (disabled): the float16 run's scaler begins anew
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*args, "--max_iters=2", "--dtype=float32")
    run(*args, "--max_iters=4", "--dtype=float16", "--init_from=resume")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 4 and saved["scaler"]["scale"] > 0


def test_a_resume_at_another_block_size_says_its_batches_differ(data_dir, tmp_path):
    # the windows a step draws follow block_size: a resume with another one trains on, saying so
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*args, "--max_iters=2")
    out = run(*args, "--max_iters=4", "--init_from=resume", "--block_size=8")
    assert "warning: seed, sequences, block_size or the sequences of an update" in out.stdout
    out = run(*args, "--max_iters=6", "--init_from=resume", "--block_size=8")
    assert "warning" not in out.stdout
    # under max_epochs an update of another size counts the epochs anew: their checkpoints may come again
    out = run(*args, "--max_iters=8", "--init_from=resume", "--block_size=8", "--batch_size=2", "--max_epochs=9")
    assert "(and its epochs are counted anew: a ckpt_epoch_N may be written again)" in out.stdout


@pytest.mark.slow
def test_out_dir_that_cannot_be_written_or_holds_no_checkpoint_is_refused_before_training(data_dir, tmp_path):
    (tmp_path / "file").write_text("")
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'file' / 'out'}", check=False)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert f"cannot write in out_dir={tmp_path / 'file' / 'out'} (Not a directory): choose a folder" in out.stderr

    def free(nbytes):  # a config file that makes the disk seem to have nbytes free
        path = tmp_path / f"free_{nbytes}.py"
        path.write_text("import atexit as _atexit, shutil as _shutil, types as _types\n_usage = _shutil.disk_usage\n"
                        "_shutil.disk_usage = lambda path: "
                        f"_types.SimpleNamespace(total=10**12, used=10**12, free={nbytes})\n"
                        "_atexit.register(lambda: setattr(_shutil, 'disk_usage', _usage))\n")
        return str(path)
    args = [*TINY, f"--data_dir={data_dir}", "--max_iters=2", "--eval_interval=2"]
    out = run(*args, f"--out_dir={tmp_path / 'small'}", free(1000), check=False)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0
    assert "0.0 MB free in" in out.stderr and "make room, or choose another out_dir" in out.stderr
    assert not (tmp_path / "small" / "metrics.jsonl").exists()  # refused before the first step
    out = run(*args, f"--out_dir={tmp_path / 'short'}", free(600_000))  # one checkpoint fits, four do not
    assert "a save holds up to 4 at once (the last and the new one, ckpt_best and its new copy)" in out.stdout
    assert torch.load(tmp_path / "short" / "ckpt.pt", weights_only=True)["iter_num"] == 2
    size = (tmp_path / "short" / "ckpt.pt").stat().st_size
    # the checkpoints there count as room (a save replaces them): ckpt.pt and ckpt_best.pt, and 2 more free
    out = run(*args, f"--out_dir={tmp_path / 'short'}", "--max_iters=4", "--init_from=resume", free(2 * size + 1000))
    assert "warning" not in out.stdout
    # with keep_last_n=2: 3 step copies more at a save's peak (2 kept, the new one)
    out = run(*args, f"--out_dir={tmp_path / 'short'}", "--max_iters=6", "--init_from=resume", "--keep_last_n=2",
              free(2 * size + 1000))
    assert "a save holds up to 7 at once (the last and the new one, ckpt_best and its new copy, keep_last_n step " \
           "copies and the new one)" in out.stdout


def test_metrics_that_cannot_be_written_warn_once_and_training_goes_on(data_dir, tmp_path):
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*args, "--max_iters=2")
    # every write of a record: No space left on device (a config file is code: it stands in for a full disk)
    full = tmp_path / "full_disk.py"
    full.write_text("import errno as _errno\nimport lib.metrics as _metrics\n\n\n"
                    "def _full(path, mode='w', encoding=None):\n"
                    "    raise OSError(_errno.ENOSPC, 'No space left on device', str(path))\n\n\n"
                    "_metrics.open_own = _full\n")
    out = run(*args, str(full), "--max_iters=6", "--init_from=resume")
    assert out.stdout.count("warning: cannot write") == 1
    assert "metrics.jsonl (No space left on device); training goes on without it" in out.stdout
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 6


def failing_save_worker(rank, port, out_dir, results):
    # one of 2 processes (gloo, FSDP over both): a save into an out_dir gone (a folder moved, a mount lost) -> what
    # each process raised, as one line, in results/RANK.json. The group's timeout (20 s) ends a wait that would
    # otherwise last dist_timeout.
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh
    from lib import checkpoint as ckpt
    from lib.optim import build_optimizers
    from lib.parallel import parallelize
    from lib.settings import defaults
    from model import GPT, GPTConfig
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                         timeout=timedelta(seconds=20))
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))
    parallelize(model, init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp")), fsdp=True)
    optimizers = build_optimizers(model, defaults(), "cpu")
    try:
        ckpt.save(out_dir, {"iter_num": 4}, model, optimizers, sharded=True, lora=0)
        said = "saved"
    except Exception as e:
        said = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(said, f)
    # both have said it; gloo's teardown, peers leaving, can still abort a process ("terminate called without an
    # active exception", files.one_line_errors), which is not what this test is about: leave without it
    torch.distributed.barrier()
    os._exit(0)


@pytest.mark.slow
def test_a_sharded_save_into_an_out_dir_gone_ends_every_process_in_one_line(tmp_path):
    # The master's sweep of unfinished saves is the first thing to touch out_dir: where it fails, every process
    # fails with it, in one line, at once; not the master alone, which left the others waiting at the next collective
    # until dist_timeout and then a traceback
    from helpers import free_port
    results = tmp_path / "results"
    results.mkdir()
    torch.multiprocessing.spawn(failing_save_worker, args=(free_port(), str(tmp_path / "gone"), str(results)),
                                nprocs=2)
    said = [json.loads((results / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert all(line.startswith(f"UserError: could not write the checkpoint of step 4 in {tmp_path / 'gone'} (No such "
                               f"file or directory)") for line in said), said


def test_a_sharded_save_that_failed_names_its_ranks_own_error(tmp_path):
    # DCP wraps each failed rank's error in one CheckpointException, whose own line names only the ranks: the line
    # a failed save ends in says what went wrong there (and the disk, where it is that)
    import errno
    import traceback
    from torch.distributed.checkpoint.api import CheckpointException
    from lib import checkpoint as ckpt
    gone = OSError(errno.ENOENT, "No such file or directory", str(tmp_path / "ckpt.tmp"))
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt.tmp"))
    too_large = OSError(errno.EFBIG, "File too large", str(tmp_path / "ckpt.tmp"))  # ulimit -f, or FAT's 4 GiB
    read_only = OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ckpt.tmp"))
    for error, why, fix in ((gone, "(No such file or directory)", "make room (or move out_dir)"),
                            (read_only, "(Read-only file system)", "make out_dir writable again (its permissions, or "
                                                                  "a mount gone read-only)"),
                            (full, "(No space left on device: about 0.0 MB needed", "make room (or move out_dir)"),
                            (too_large, "(File too large)", "raise the file size limit (ulimit -f), or move out_dir")):
        wrapped = CheckpointException("save failed", {1: (error, traceback.StackSummary())})
        line = ckpt.failed_save(str(tmp_path), 4, True, wrapped, needed=10)
        assert line.startswith(f"could not write the checkpoint of step 4 in {tmp_path} {why}"), line
        assert f"no earlier checkpoint was written: {fix}" in line, line
    # a disk that is also short of room does not make another error a full disk
    line = ckpt.failed_save(str(tmp_path), 4, True, read_only, needed=1 << 60)
    assert "(Read-only file system)" in line and "make out_dir writable again" in line, line
    # a disk full where a file size limit (ulimit -f) is below the checkpoint's size: the room is the fix
    import resource
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50 << 20, limit[1]))
    try:
        line = ckpt.failed_save(str(tmp_path), 4, True, full, needed=200 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    assert "(No space left on device: about 200.0 MB needed" in line, line
    assert line.endswith("no earlier checkpoint was written: make room (or move out_dir), then resume with "
                         "--init_from=auto"), line


@pytest.mark.slow
def test_a_checkpoint_past_the_file_size_limit_ends_the_run_in_one_line_naming_the_limit(data_dir, tmp_path):
    # ulimit -f (a shell's, a scheduler's): torch.save's write that the limit cuts short within a tensor's bytes
    # fails as "unexpected pos", not as an OSError, with the disk far from full; the line names the limit, not room
    import resource
    import zipfile
    args = [*TINY, f"--data_dir={data_dir}", "--max_iters=4", "--eval_interval=4"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    with zipfile.ZipFile(tmp_path / "whole" / "ckpt.pt") as saved:  # the same run's checkpoint, the same layout
        largest = max(saved.infolist(), key=lambda entry: entry.file_size)
    limit = largest.header_offset + largest.file_size // 2  # within its bytes (the log and the lock are far below)
    out = tmp_path / "limited"
    done = subprocess.run([sys.executable, "train.py", *on_cpu([*args, f"--out_dir={out}"])], cwd=ROOT,
                          env={**os.environ, **CPU_ENV}, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    said = done.stderr.strip()
    assert done.returncode == 1 and len(said.splitlines()) == 1, said
    assert said.startswith(f"train.py: could not write the checkpoint of step 4 in {out}")
    assert "no earlier checkpoint was written: raise the file size limit (ulimit -f)" in said, said
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]


@pytest.mark.slow
def test_a_signal_during_an_evaluation_saves_the_step_unevaluated_and_the_resume_evaluates_it(data_dir, tmp_path):
    # An evaluation can take longer than a scheduler waits after its SIGTERM (torchrun's 30 s, Slurm's KillWait):
    # the signal ends it at its next batch, the step is saved as not yet evaluated, and the resumed run evaluates it,
    # its records then those of the run never stopped. (A config file is code: here it sends the signal itself, in
    # the 2nd batch of step 4's evaluation, the 10th of the run: eval_iters=2 batches a split.)
    args = [*TINY, f"--data_dir={data_dir}", "--max_iters=6", "--eval_interval=2", "--eval_iters=2"]
    run(*args, f"--out_dir={tmp_path / 'whole'}")
    signal_at = tmp_path / "signal_at.py"
    signal_at.write_text("import os as _os, signal as _signal\nimport lib.data as _data\n_calls = [0]\n"
                         "_evaluation = _data.Batches.evaluation\n\n\n"
                         "def _patched(self, split, k):\n    _calls[0] += 1\n    if _calls[0] == 10:\n"
                         "        _os.kill(_os.getpid(), _signal.SIGTERM)\n    return _evaluation(self, split, k)\n\n\n"
                         "_data.Batches.evaluation = _patched\n")
    out = run(*args, f"--out_dir={tmp_path / 'parts'}", str(signal_at))
    assert f"SIGTERM: saved step 4 in {tmp_path / 'parts'} and stopped" in out.stdout, out.stdout[-2000:]
    saved = torch.load(tmp_path / "parts" / "ckpt.pt", weights_only=True)
    assert saved["iter_num"] == 4 and saved["evaluated"] is False
    assert 4 not in [r["iter"] for r in map(json.loads, (tmp_path / "parts" / "metrics.jsonl").read_text()
                                            .splitlines()) if "val_loss" in r]
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--init_from=resume")

    def records(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(r["iter"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, lines)]
    assert records("parts") == records("whole")


def test_lib_launch_stops_quietly_where_the_signal_came_while_its_workers_started(monkeypatch):
    # a SIGTERM while the workers import torch or join the group (before train.py's StopRequest) ends them by its
    # default: no step was trained in this start, so the run stopped as asked (status 0), nothing lost
    from lib import launch
    monkeypatch.setattr(launch, "closed", {0: -signal.SIGTERM, 1: -signal.SIGTERM})
    line, status = launch.signalled("SIGTERM")
    assert status == 0 and line == ("torchrun: SIGTERM, its workers stopped (local rank 0, 1 while starting, before "
                                    "a step: nothing to save)"), line
    monkeypatch.setattr(launch, "closed", {0: -signal.SIGTERM, 1: -signal.SIGKILL})
    assert launch.signalled("SIGTERM")[1] == 1


def test_lib_launch_says_which_workers_torchrun_killed_after_a_signal(tmp_path):
    # torchrun's close of its workers as after a SIGTERM (the signal, a grace, then SIGKILL), here with a grace of
    # 1 s: a worker that ignores the signal is killed, and lib.launch's line names it and exits 1; one that exits as
    # asked is no failure (train.py's, all stopping: test_sigterm_under_torchrun_every_rank_stops_at_the_same_step)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    from lib import launch
    code = ("import pathlib, signal, sys, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1] == 'stubborn' else lambda *_: sys.exit(0))\n"
            "pathlib.Path(sys.argv[2]).touch()\n"
            "time.sleep(60)\n")
    ready = [tmp_path / "0", tmp_path / "1"]
    context = start_processes("worker", sys.executable, {0: ("-c", code, "obliging", str(ready[0])),
                                                         1: ("-c", code, "stubborn", str(ready[1]))},
                              {0: {}, 1: {}}, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")))
    try:
        deadline = time.time() + 120
        while not all(p.exists() for p in ready) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        context.close(signal.SIGTERM, timeout=1)
    assert launch.closed == {0: 0, 1: -signal.SIGKILL}
    line, status = launch.signalled("SIGTERM")
    assert status == 1 and line.startswith("torchrun: SIGTERM, but local rank 1 ended by SIGKILL (torchrun kills"), line
