#!/bin/bash
# The GPU call 3 of 2026-11-27 (a second session's first; BENCHMARKS.md), as run: bash experiments/gpu_2026-11-27_call3.sh
# on the GPU machine from the checkout's root, with .gpu/nanogpt (a copy of ../shared/anchors/nanogpt) and
# .gpu/hf_peft_finetune.py (from ../shared/anchors) carried.
# Issue 44 first: transformers + peft, then our fine-tuning step in process (eager: full, LoRA, LoRA with the
# candidate adapter, LoRA with the references), each profiled; then issue 43's owed whole run: nanoGPT and ours with
# its defaults (the fused loss under compile), 60 steps each, same call.
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
DEADLINE=${DEADLINE:-330}
log() { echo "$(date +%T) +${SECONDS}s $*" | tee -a $O/call.md; }
ok() { (( DEADLINE - SECONDS > ${1:-60} )); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $O/call.md
log "transformers+peft (anchor)"
timeout 100 python3 .gpu/hf_peft_finetune.py 2>&1 | grep "^|" | tee -a $O/call.md
for v in "full" "lora" "lora --lean" "lora --kernels=0" "full --kernels=0"; do
  ok 40 || { log "no time: $v"; continue; }
  timeout 60 python3 experiments/gpu_finetune_step.py $v --out=$O 2>&1 | grep "ms/step\|Error" | tee -a $O/call.md
done
NG=/tmp/ng; rm -rf $NG; cp -r .gpu/nanogpt $NG; mkdir -p $NG/data/rnd
python3 -c "
import numpy as np
r = np.random.default_rng(0)
for s in ('train', 'val'):
    r.integers(0, 50257, size=4_000_000, dtype=np.uint16).tofile('$NG/data/rnd/%s.bin' % s)
"
COMMON="--batch_size=16 --block_size=1024 --gradient_accumulation_steps=1 --max_iters=60 --lr_decay_iters=60 --eval_interval=100000 --eval_iters=1 --log_interval=1 --compile=True --always_save_checkpoint=False"
ok 150 && { log "nanoGPT train.py"; (cd $NG && timeout 110 python3 train.py --dataset=rnd $COMMON --out_dir=/tmp/o-ng) > $O/train-nanogpt.log 2>&1; log "rc=$?"; }
ok 80 && { log "ours train.py config/train_gpt2.py, defaults"; timeout $((DEADLINE - SECONDS)) python3 train.py config/train_gpt2.py --data_dir=$NG/data/rnd $COMMON --warmup_iters=5 --out_dir=/tmp/o-ours > $O/train-ours.log 2>&1; log "rc=$?"; cp /tmp/o-ours/metrics.jsonl $O/train-ours.jsonl 2>/dev/null; }
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
grep -m1 "^iter 30\|^step 30\|mfu" $O/train-ours.log | head -2 | tee -a $O/call.md
log end
