"""
Measurements. Training throughput of a config runs the real train.py, once per value of a switch
(eager against torch.compile by default), and reports the median tokens/s, ms/iter and MFU of the
steps after warmup, and peak memory:

    python bench.py config/train_small.py
    python bench.py config/train_gpt2.py --synthetic --compare=use_kernels --steps=30

--synthetic trains on random tokens (no prepared data needed); any other --key=value goes to train.py.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compare", default="compile", help="a True/False setting of train.py to run both ways")
parser.add_argument("--steps", type=int, default=50, help="training steps per run")
parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
parser.add_argument("--synthetic", action="store_true", help="random tokens (vocab 50257) instead of data_dir")
args, train_args = parser.parse_known_args()
if args.warmup >= args.steps:
    sys.exit(f"bench.py: --warmup={args.warmup} leaves no steps to measure of --steps={args.steps}")

# -----------------------------------------------------------------------------
# train.py's throughput, both ways


def run_train(extra, out_dir):
    # train.py's own log records, one per step after warmup
    cmd = [sys.executable, "train.py", *train_args, *extra, f"--out_dir={out_dir}", f"--max_iters={args.steps}",
           "--log_interval=1", f"--eval_interval={args.steps + 1}", "--eval_iters=1", "--always_save_checkpoint=False"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"bench.py: train.py failed:\n{done.stdout[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return [r for r in records if "tokens_per_s" in r and r["iter"] > args.warmup]


with tempfile.TemporaryDirectory() as tmp:
    if args.synthetic:
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            rng.integers(0, 50257, size=2_000_000, dtype=np.uint16).tofile(os.path.join(tmp, f"{split}.bin"))
        train_args.append(f"--data_dir={tmp}")  # no meta.json: read as GPT-2 tokens
    rows = []
    for value in (False, True):
        records = run_train([f"--{args.compare}={value}"], os.path.join(tmp, f"out_{value}"))
        med = {k: statistics.median(r[k] for r in records) for k in ("tokens_per_s", "ms_per_iter", "mfu")}
        rows.append((f"{args.compare}={value}", med, max(r["mem_mb"] for r in records)))

print(f"\n{' '.join(train_args)}, {args.steps} steps, medians after {args.warmup}")
print("| run | tokens/s | ms/iter | MFU | peak memory MB |\n| --- | --- | --- | --- | --- |")
for name, med, mem in rows:
    print(f"| {name} | {med['tokens_per_s']:,.0f} | {med['ms_per_iter']:.1f} | {med['mfu'] * 100:.1f}% | {mem:,.0f} |")
print(f"speedup of {rows[1][0]}: {rows[1][1]['tokens_per_s'] / rows[0][1]['tokens_per_s']:.2f}x")
