#!/bin/bash
# The GPU call 4 of 2026-11-27 (BENCHMARKS.md), as run: bash experiments/gpu_2026-11-27_call4.sh on the GPU machine
# from the checkout's root, with .gpu/nanogpt (a copy of ../shared/anchors/nanogpt) carried.
# Issue 44: our fine-tuning step compiled (LoRA with the adapter of call 3's --lean, then full); issue 43's owed
# whole runs in one call: nanoGPT and ours with its defaults (the fused loss under compile), 60 steps each.
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
DEADLINE=${DEADLINE:-420}
log() { echo "$(date +%T) +${SECONDS}s $*" | tee -a $O/call.md; }
ok() { (( DEADLINE - SECONDS > ${1:-60} )); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $O/call.md
log "LoRA (lean adapter) compiled"
timeout 150 python3 experiments/gpu_finetune_step.py lora --lean --compile=1 --out=$O 2>&1 | grep "ms/step\|Error" | tee -a $O/call.md
NG=/tmp/ng; rm -rf $NG; cp -r .gpu/nanogpt $NG; mkdir -p $NG/data/rnd
python3 -c "
import numpy as np
r = np.random.default_rng(0)
for s in ('train', 'val'):
    r.integers(0, 50257, size=4_000_000, dtype=np.uint16).tofile('$NG/data/rnd/%s.bin' % s)
"
COMMON="--batch_size=16 --block_size=1024 --gradient_accumulation_steps=1 --max_iters=60 --lr_decay_iters=60 --eval_interval=100000 --eval_iters=1 --log_interval=1 --compile=True --always_save_checkpoint=False"
ok 170 && { log "nanoGPT train.py"; (cd $NG && timeout 110 python3 train.py --dataset=rnd $COMMON --out_dir=/tmp/o-ng) > $O/train-nanogpt.log 2>&1; log "rc=$?"; }
ok 60 && { log "ours train.py config/train_gpt2.py, defaults"; timeout 90 python3 train.py config/train_gpt2.py --data_dir=$NG/data/rnd $COMMON --warmup_iters=5 --out_dir=/tmp/o-ours > $O/train-ours.log 2>&1; log "rc=$?"; cp /tmp/o-ours/metrics.jsonl $O/train-ours.jsonl 2>/dev/null; }
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
grep -m1 "^iter 30" $O/train-ours.log | tee -a $O/call.md
ok 60 && { log "full compiled"; timeout $((DEADLINE - SECONDS)) python3 experiments/gpu_finetune_step.py full --compile=1 --out=$O 2>&1 | grep "ms/step\|Error" | tee -a $O/call.md; }
log end
