"""
One compiled training step of GPT-2 124M (16 x 1024 tokens, bf16 autocast, fused AdamW, clipping), timed and
profiled in process: nanoGPT's model (imported from its folder, run unchanged) or ours, with switches for what
the step is made of. The loop holds no host work but the step itself, so the time is the device's; train.py's
own time beside it is the loop's share.

    python experiments/gpu_step.py ours --kernels=0 --out=gpu          # ours, the PyTorch references
    python experiments/gpu_step.py nanogpt --nanogpt=NANOGPT_CLONE --out=gpu
    python experiments/gpu_step.py ours --tiny                           # on a CPU, a smoke test

NANOGPT_CLONE is a clone of nanoGPT, e.g. `git clone https://github.com/karpathy/nanoGPT`.

It prints one line (label, ms/step, tokens/s, peak memory) and writes the profiler's table (CUDA time by op,
the top 30) to OUT/profile-LABEL.txt. Kept as it ran on 2026-11-27 (BENCHMARKS.md); the maintained form of
the same measurement is `bench.py --mode=gpu --section=versus` (benchmarks/measure.py's profiled_step).
"""

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as model_module  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from lib.optim import build_optimizers
from lib.settings import defaults

p = argparse.ArgumentParser()
p.add_argument("which", choices=["ours", "nanogpt"])
p.add_argument("--nanogpt", help="nanoGPT's folder (its model.py is imported from there)")
p.add_argument("--kernels", type=int, default=None, help="ours: use_kernels 1/0 (default: the model's auto)")
p.add_argument("--sdpa", default="", help="cudnn: only cuDNN's attention; flash: only flash")
p.add_argument("--lce", default="", help="fused: the fused linear cross-entropy where the reference would run")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--sync", action="store_true", help="read the loss on the host after every step")
p.add_argument("--compile", type=int, default=1)
p.add_argument("--tiny", action="store_true")
p.add_argument("--out", default=".")
p.add_argument("--label", default="")
a = p.parse_args()

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
if a.sdpa:
    for name in ("flash", "mem_efficient", "cudnn", "math"):
        getattr(torch.backends.cuda, f"enable_{name}_sdp")(name == a.sdpa)
shape = dict(n_layer=2, n_head=2, n_embd=64, block_size=64) if a.tiny else \
    dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)
B = 2 if a.tiny else 16
T = shape["block_size"]

if a.lce == "fused":
    import kernels
    model_module.linear_cross_entropy = kernels.linear_cross_entropy
if a.which == "ours":
    kernels = None if a.kernels is None else bool(a.kernels)
    model = GPT(GPTConfig(vocab_size=50304, dropout=0.0, use_kernels=kernels, **shape)).to(device)
    opt = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                           "learning_rate": 6e-4, "weight_decay": 0.1}, device)[0]
else:
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(a.nanogpt, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.GPT(module.GPTConfig(vocab_size=50304, dropout=0.0, bias=False, **shape)).to(device)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device)
label = a.label or f"{a.which}" + (f"-kernels{a.kernels}" if a.which == "ours" else "") + \
    (f"-sdpa-{a.sdpa}" if a.sdpa else "") + (f"-lce-{a.lce}" if a.lce else "") + ("-sync" if a.sync else "")
compiled = torch.compile(model) if a.compile else model  # the module, as both train.py's compile it
autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cuda)
data = [torch.randint(0, 50257, (B, T + 1), device=device) for _ in range(4)]
data = [(xy[:, :-1].contiguous(), xy[:, 1:].contiguous()) for xy in data]


def step(i):
    x, y = data[i % len(data)]
    with autocast:
        loss = compiled(x, y)[1]
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item() if a.sync else loss


began = time.time()
for i in range(3):
    step(i)
if cuda:
    torch.cuda.synchronize()
warm = time.time() - began
times = []
for i in range(a.steps):
    if cuda:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
    t0 = time.perf_counter()
    step(i)
    if cuda:
        e1.record()
        times.append((e0, e1))
    else:
        times.append(time.perf_counter() - t0)
if cuda:
    torch.cuda.synchronize()
    ms = [e0.elapsed_time(e1) for e0, e1 in times]
else:
    ms = [t * 1000 for t in times]
med = statistics.median(ms[len(ms) // 3:])
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else 0
print(f"{label}: {med:.2f} ms/step, {B * T / med * 1000:,.0f} tokens/s, peak {peak:,.0f} MB, "
      f"compile+3 steps {warm:.0f} s, params {sum(q.numel() for q in model.parameters()) / 1e6:.2f}M", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=activities) as prof:
    for i in range(3):
        step(i)
    if cuda:
        torch.cuda.synchronize()
sort = "cuda_time_total" if cuda else "cpu_time_total"
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, f"profile-{label}.txt"), "w") as f:
    f.write(f"{label}: {med:.2f} ms/step (median of steps past the first third of {a.steps}), 3 steps profiled\n")
    f.write(prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=70))
