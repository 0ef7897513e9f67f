#!/bin/bash
# The GPU call 2 of 2026-11-27 (BENCHMARKS.md, the H200 section), as run: bash experiments/gpu_2026-11-27_call2.sh on the
# GPU machine from the checkout's root, with .gpu/nanogpt (a copy of ../shared/anchors/nanogpt), .gpu/before (git archive of
# 4edc78f) and .gpu/hf_peft_finetune.py (from ../shared/anchors) carried.
# call 2: nanoGPT, ours before (HEAD 4edc78f, .gpu/before) and after (this tree), 60 steps each, same call;
# the fused loss alone under compile; then issue 44's baseline: transformers+peft and our fine-tuning rows
set -u
export PYTHONUNBUFFERED=1
O=${OUT:-/tmp/out}; mkdir -p $O
DEADLINE=${DEADLINE:-470}
log() { echo "$(date +%T) +${SECONDS}s $*" | tee -a $O/call.md; }
ok() { (( DEADLINE - SECONDS > ${1:-60} )); }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $O/call.md
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
for side in before after; do
  ok 70 || { log "no time: $side"; continue; }
  dir=.gpu/before; [[ $side == after ]] && dir=.
  log "ours ($side) train.py config/train_gpt2.py, defaults"
  (cd $dir && timeout 150 python3 train.py config/train_gpt2.py --data_dir=$NG/data/rnd $COMMON --warmup_iters=5 --out_dir=/tmp/o-$side) > $O/train-ours-$side.log 2>&1; log "rc=$?"
  cp /tmp/o-$side/metrics.jsonl $O/train-ours-$side.jsonl 2>/dev/null; rm -rf /tmp/o-$side
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
grep -m1 "^iter 30" $O/train-ours-after.log | tee -a $O/call.md
for v in "ours" "ours --lce=fused"; do
  ok 60 || { log "no time: step $v"; continue; }
  log "gpu_step $v"
  timeout 100 python3 experiments/gpu_step.py $v --out=$O 2>&1 | grep "ms/step" | tee -a $O/call.md
done
ok 60 && { log "transformers+peft (anchor)"; timeout 120 python3 .gpu/hf_peft_finetune.py 2>&1 | grep "^|" | tee -a $O/call.md; }
ok 90 && { log "ours: full, LoRA (eager), LoRA compiled"; timeout $((DEADLINE - SECONDS)) python3 - <<'PY' 2>&1 | grep -v "^USDT" | tee -a $O/call.md
from benchmarks import measure
measure.set_deadline(3.5)
measure.bench_lora([], skip=["LoRA, int8 base", "QLoRA"], extra_args=["--batch_size=1", "--block_size=1024"], scratch="/tmp")
measure.bench_lora(["--compile=True"], name="Qwen3-0.6B compiled", skip=["full", "LoRA, int8 base", "QLoRA"], extra_args=["--batch_size=1", "--block_size=1024"], scratch="/tmp")
PY
}
log end
