#!/bin/bash
# The GPU call 5 of 2026-11-27 (BENCHMARKS.md), as run: bash experiments/gpu_2026-11-27_call5.sh on the GPU machine from
# the checkout's root, with .gpu/nanogpt (a copy of ../shared/anchors/nanogpt) carried: nanoGPT and ours with its
# defaults in one call (calls 3 and 4 had them in two), the same 60 steps at nanoGPT's shape, a fresh out_dir each.
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $O/call.md
NG=/tmp/ng5; rm -rf $NG /tmp/o5-*; cp -r .gpu/nanogpt $NG; mkdir -p $NG/data/rnd
python3 -c "
import numpy as np
r = np.random.default_rng(0)
for s in ('train', 'val'):
    r.integers(0, 50257, size=4_000_000, dtype=np.uint16).tofile('$NG/data/rnd/%s.bin' % s)
"
COMMON="--batch_size=16 --block_size=1024 --gradient_accumulation_steps=1 --max_iters=60 --lr_decay_iters=60 --eval_interval=100000 --eval_iters=1 --log_interval=1 --compile=True --always_save_checkpoint=False"
echo "+${SECONDS}s ours" | tee -a $O/call.md
timeout 80 python3 train.py config/train_gpt2.py --data_dir=$NG/data/rnd $COMMON --warmup_iters=5 --out_dir=/tmp/o5-ours > $O/train-ours.log 2>&1; echo "rc=$?" | tee -a $O/call.md
cp /tmp/o5-ours/metrics.jsonl $O/train-ours.jsonl
echo "+${SECONDS}s nanoGPT" | tee -a $O/call.md
(cd $NG && timeout 80 python3 train.py --dataset=rnd $COMMON --out_dir=/tmp/o5-ng) > $O/train-nanogpt.log 2>&1; echo "rc=$?" | tee -a $O/call.md
python3 - $O <<'PY' 2>&1 | tee -a $O/call.md
import re, statistics, sys, os, json
out = sys.argv[1]
ng = [float(x) for x in re.findall(r"time ([0-9.]+)ms", open(os.path.join(out, "train-nanogpt.log")).read())]
ours = [r["ms_per_iter"] for r in map(json.loads, open(os.path.join(out, "train-ours.jsonl"))) if "ms_per_iter" in r]
med = {k: statistics.median(v[len(v) // 3:]) for k, v in (("nanoGPT", ng), ("ours", ours)) if v}
for k, m in med.items():
    print(f"{k}: {m:.2f} ms/step, {16384 / m * 1000:,.0f} tok/s, {med['nanoGPT'] / m if 'nanoGPT' in med else float('nan'):.3f}x nanoGPT")
PY
grep -m1 "^iter 30" $O/train-ours.log | tee -a $O/call.md
echo "+${SECONDS}s end" | tee -a $O/call.md
