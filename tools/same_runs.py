"""
Whether a change left training as it was: the same dozen-odd CPU runs (plain, accumulation, Muon, doc mask, the
Triton kernels, DDP, FSDP, tensor parallel, conversations, an imported model's full, LoRA and QLoRA fine-tunes,
a resume of a checkpoint the other checkout wrote, a diverging run) made by another checkout and by this one, and
compared: every record of metrics.jsonl but its timings, every tensor and value of every checkpoint, bit for
bit, the sample text, the stdout less its timings, and the exit status with the last line of stderr.

    git worktree add /tmp/before HEAD~1
    python tools/same_runs.py /tmp/before     # each run's verdict; exit status 1 on a difference or a failed run
    python tools/same_runs.py /tmp/before --only=plain,ddp

Both checkouts run with this Python, on CPU, one at a time, in out_dirs of the same path (so that the paths
written into checkpoints agree). Needs torchao for the QLoRA run (else it is left out, and said so).
"""

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
from lib.resume import load_checkpoint  # noqa: E402 (this checkout's: a file, or a sharded folder, whole)
TINY = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=20", "--learning_rate=1e-2",
        "--max_iters=8", "--eval_interval=4", "--keep_last_n=2", "--device=cpu"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=0"]
TIMINGS = {"ms_per_iter", "tokens_per_s", "mfu", "mfu_run", "mem_mb", "time_left_s", "elapsed_s"}
# the runs: name -> (launcher, data, train.py's arguments, environment); data: text, chat or folder (the tiny
# imported model, fine-tuned on the text)
RUNS = {
    "plain": ([], "text", [], {}),
    "accumulation": ([], "text", ["--batch_size=2", "--gradient_accumulation_steps=4"], {}),
    "muon": ([], "text", ["--optimizer=muon"], {}),
    "doc_mask": ([], "text", ["--doc_mask=True"], {}),
    "kernels": ([], "text", ["--use_kernels=True"], {"TRITON_INTERPRET": "1"}),
    "ddp": (TORCHRUN, "text", ["--gradient_accumulation_steps=2"], {}),
    "fsdp": (TORCHRUN, "text", ["--fsdp=True", "--gradient_accumulation_steps=2"], {}),
    "tensor_parallel": (TORCHRUN, "text", ["--tp_size=2"], {}),
    "epochs": ([], "chat", ["--sequences=examples", "--max_epochs=1", "--gradient_accumulation_steps=2"], {}),
    "chat_ddp": (TORCHRUN, "chat", ["--sequences=examples", "--gradient_accumulation_steps=2"], {}),
    "finetune": ([], "folder", [], {}),
    "lora": ([], "folder", ["--lora_rank=4"], {}),
    "qlora": ([], "folder", ["--lora_rank=4", "--lora_base_dtype=nf4"], {}),
    "resume": ([], "text", ["--init_from=resume", "--max_iters=12"], {}),  # of the other checkout's plain run
    "diverges": ([], "text", ["--learning_rate=1e9", "--max_skipped_steps=2"], {}),
}


def make_data(work):
    # a text dataset (characters of this Python's json package), conversations (BPE), and a tiny imported model
    # with its data: made once, by this checkout, read by both
    stdlib = Path(sysconfig.get_paths()["stdlib"]) / "json"
    prepare = [sys.executable, "prepare.py"]
    quiet = dict(cwd=HERE, check=True, capture_output=True)
    subprocess.run([*prepare, str(stdlib), "--tokenizer=char", f"--out_dir={work / 'text'}"], **quiet)
    words = "apple river stone cloud night green quiet tower seven bread".split()
    with open(work / "chats.jsonl", "w") as f:
        for i in range(300):
            said = [words[(i * 7 + k * 3) % len(words)] for k in range(1 + i % 6)]
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(said)},
                                             {"role": "assistant", "content": " ".join(reversed(said))}]}) + "\n")
    subprocess.run([*prepare, str(work / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={work / 'chat'}"], **quiet)
    from lib.hf import save_pretrained
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    save_pretrained(GPT(GPTConfig(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=64)),
                    work / "model")


def run(checkout, name, work, out):
    launcher, data, args, env = RUNS[name]
    init = [f"--init_from={work / 'model'}", "--block_size=32"] if data == "folder" else []
    data_dir = work / ("text" if data == "folder" else data)
    command = [*(launcher or [sys.executable]), "train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}",
               *init, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0", **env}
    done = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    # (torch's warnings begin with the time, the process, the file and maybe the rank: left out)
    last = re.sub(r"^(\[rank\d+\]:)?[DIWEF]\d{4} \S+ \d+ \S+\] ", "", (done.stderr.strip().splitlines() or [""])[-1])
    found = {"status": done.returncode, "stderr": last,
             "stdout": [masked(line) for line in done.stdout.splitlines() if keep(line)]}
    if (out / "metrics.jsonl").exists():
        found["metrics"] = [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
                            for line in (out / "metrics.jsonl").read_text().splitlines()]
    # a file checkpoint, or a sharded one's folder (its .metadata, a pickle, differs from save to save: it is read)
    found["checkpoints"] = {str(p.relative_to(out)): p for p in sorted(out.rglob("*"))
                            if p.suffix == ".pt" and p.is_file() or (p / ".metadata").is_file()}
    if (out / "ckpt.pt").exists() or (out / "ckpt").is_dir():
        sample = subprocess.run([sys.executable, "sample.py", f"--out_dir={out}", "--num_samples=2",
                                 "--max_new_tokens=40", "--device=cpu", "--seed=1"],
                                cwd=checkout, env=env, capture_output=True, text=True, timeout=300)
        found["sample"] = (sample.returncode, sample.stdout)
    return found


def keep(line):
    return not any(s in line for s in ("wall time", "an evaluation took", "ms/iter"))


def masked(line):
    return re.sub(r"\d+(\.\d+)? ?(ms|MB|GB|s)\b", "#", line)


def same_value(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    return a == b or (a != a and b != b)  # NaN is NaN


def differing_keys(a, b):
    # the top-level keys of two checkpoints whose values differ (or that only one has), to say what a DIFFERS is
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not same_value(a[k], b[k]))


def differences(before, after):
    found = [key for key in ("status", "metrics", "sample") if before.get(key) != after.get(key)]
    if before["stdout"] != after["stdout"]:
        lines = [line for line in after["stdout"] if line not in before["stdout"]]
        found.append(f"stdout ({len(lines)} lines new, the first: {lines[0][:160] if lines else ''!r})")
    if before["stderr"] != after["stderr"]:
        found.append(f"stderr's last line {before['stderr']!r} against {after['stderr']!r}")
    if before["checkpoints"].keys() != after["checkpoints"].keys():
        found.append(f"checkpoint files {sorted(before['checkpoints'])} against {sorted(after['checkpoints'])}")
    for name in before["checkpoints"].keys() & after["checkpoints"].keys():
        a, b = before["checkpoints"][name], after["checkpoints"][name]
        a_state, b_state = load_checkpoint(str(a)), load_checkpoint(str(b))
        same = same_value(a_state, b_state)
        if a.is_dir():  # and the shards themselves (the optimizer's too), byte for byte
            shards = sorted(p.name for p in a.glob("*.distcp"))
            same = same and shards == sorted(p.name for p in b.glob("*.distcp")) and all(
                (a / n).read_bytes() == (b / n).read_bytes() for n in shards)
        if not same:
            found.append(f"checkpoint {name} (keys {', '.join(differing_keys(a_state, b_state)) or 'none: its shards'})")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("before", help="the other checkout (a git worktree of the commit to compare with)")
    parser.add_argument("--only", default="", help="comma-separated run names (default: all of them)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and print where")
    options = parser.parse_args()
    names = options.only.split(",") if options.only else list(RUNS)
    before = Path(options.before).resolve()
    if not (before / "train.py").is_file():
        raise SystemExit(f"{options.before} is no checkout of the trainer (no train.py there): make one with "
                         f"git worktree add /tmp/before REVISION")
    if unknown := [name for name in names if name not in RUNS]:
        raise SystemExit(f"no run named {', '.join(unknown)}: the runs are {', '.join(RUNS)}")
    if "resume" in names:  # it resumes the plain run, made first
        names = ["plain"] + [name for name in names if name != "plain"]
    for name, package in (("qlora", "torchao"), ("kernels", "triton")):
        if name in names and importlib.util.find_spec(package) is None:
            print(f"{name}: left out (no {package})")
            names.remove(name)
    work = Path(tempfile.mkdtemp(prefix="same_runs_"))
    try:
        failed = compare(names, before, work)
    finally:
        if options.keep:
            print(f"runs kept in {work}")
        else:
            shutil.rmtree(work)
    sys.exit(1 if failed else 0)


def compare(names, before, work):
    # each run by both checkouts, its verdict printed -> how many differ or fail (but the diverging run, meant to)
    make_data(work)
    failed = 0
    for name in names:
        out, results = work / "runs" / name, {}
        for side, checkout in (("before", before), ("after", HERE)):
            if name == "resume":  # both resume the other checkout's plain run
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(work / "plain_before", out)
            results[side] = run(checkout, name, work, out)
            out.mkdir(parents=True, exist_ok=True)  # (a run that failed before making it)
            shutil.move(out, work / f"{name}_{side}")
            results[side]["checkpoints"] = {k: work / f"{name}_{side}" / k for k in results[side]["checkpoints"]}
        if name == "plain" and results["before"]["status"]:
            raise SystemExit(f"the plain run failed:\n{results['before']['stderr']}")
        found = differences(results["before"], results["after"])
        status = results["after"]["status"]
        steps = len([r for r in results["after"].get("metrics", []) if "val_loss" not in r])
        broke = status and name != "diverges"  # the same failure on both sides compares nothing
        verdict = "DIFFERS: " + ", ".join(found) if found else \
            f"FAILED on both sides: {results['after']['stderr'][:160]}" if broke else "the same"
        print(f"{name}: {verdict} (exit {status}, {steps} step records, {len(results['after']['checkpoints'])} "
              f"checkpoint files)", flush=True)
        failed += bool(found or broke)
    return failed


if __name__ == "__main__":
    main()
