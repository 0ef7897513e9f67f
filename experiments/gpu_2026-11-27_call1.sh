#!/bin/bash
# The GPU call 1 of 2026-11-27 (BENCHMARKS.md, the H200 section), as run: bash experiments/gpu_2026-11-27_call1.sh on the
# GPU machine from the checkout's root, with .gpu/nanogpt (a copy of ../shared/anchors/nanogpt) carried.
# call 1: the baseline side by side (nanoGPT's train.py and ours, 60 steps, 16 x 1024, compile), then one
# compiled step of each profiled (experiments/gpu_step.py)
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
DEADLINE=${DEADLINE:-400}
log() { echo "$(date +%T) +${SECONDS}s $*" | tee -a $O/call.md; }
ok() { (( DEADLINE - SECONDS > ${1:-60} )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee -a $O/call.md
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $O/call.md
NG=/tmp/ng; rm -rf $NG; cp -r .gpu/nanogpt $NG; mkdir -p $NG/data/rnd
python3 -c "
import numpy as np
r = np.random.default_rng(0)
for s in ('train', 'val'):
    r.integers(0, 50257, size=4_000_000, dtype=np.uint16).tofile('$NG/data/rnd/%s.bin' % s)
"
COMMON="--batch_size=16 --block_size=1024 --gradient_accumulation_steps=1 --max_iters=60 --lr_decay_iters=60 --eval_interval=100000 --eval_iters=1 --log_interval=1 --compile=True --always_save_checkpoint=False"
log "nanoGPT train.py"
(cd $NG && timeout 150 python3 train.py --dataset=rnd $COMMON --out_dir=/tmp/o-ng) > $O/train-nanogpt.log 2>&1; log "rc=$?"
for k in False True; do
  ok 70 || { log "no time: ours $k"; continue; }
  log "ours train.py use_kernels=$k"
  timeout 150 python3 train.py config/train_gpt2.py --data_dir=$NG/data/rnd $COMMON --warmup_iters=5 --use_kernels=$k --out_dir=/tmp/o-$k > $O/train-ours-$k.log 2>&1; log "rc=$?"
  cp /tmp/o-$k/metrics.jsonl $O/train-ours-$k.jsonl 2>/dev/null
done
python3 - $O <<'PY' 2>&1 | tee -a $O/call.md
import re, statistics, sys, glob, os, json
out = sys.argv[1]
for f in sorted(glob.glob(os.path.join(out, "train-*.log"))):
    ms = [float(x) for x in re.findall(r"time ([0-9.]+)ms", open(f).read())]
    jl = f[:-4] + ".jsonl"
    if os.path.exists(jl):
        ms = [r["ms_per_iter"] for r in map(json.loads, open(jl)) if "ms_per_iter" in r]
    tail = ms[len(ms) // 3:]
    med = statistics.median(tail) if tail else float("nan")
    print(f"{os.path.basename(f)}: {len(ms)} steps; median ms/step past the first third {med:.2f}, {16384 / med * 1000:,.0f} tok/s")
PY
for v in "nanogpt --nanogpt=$NG" "ours --kernels=0" "ours --kernels=1" "ours --kernels=0 --sdpa=cudnn" "ours --kernels=0 --sync"; do
  ok 50 || { log "no time: step $v"; continue; }
  log "gpu_step $v"
  timeout 120 python3 experiments/gpu_step.py $v --out=$O 2>&1 | grep -v "^USDT\|^num \|^using\|^number" | tee -a $O/call.md
done
log end
