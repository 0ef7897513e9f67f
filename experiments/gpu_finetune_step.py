"""
One fine-tuning step of the Qwen3-0.6B shape (random weights, micro-batch 1 x 1024, bf16 autocast, fused AdamW,
clipping at 1, one read of the loss a step: train.py's step), timed by the wall clock and profiled in process,
to find where ours loses to transformers + peft. Rows: full (fp32 weights), LoRA r16 on the seven
projections (a bf16 base, fp32 adapters), each eager or compiled, kernels on or off; --lean runs LoRA's adapter
with no fp32 copy of its input under autocast and the scale on the rank-16 middle, as lib/lora.py now does
(so --lean and the default are the same).

    python experiments/gpu_finetune_step.py lora --out=gpu            # on the GPU machine
    python experiments/gpu_finetune_step.py lora --tiny               # on a CPU, a smoke test

It prints one line (label, ms/step, tokens/s, peak MB, the device's busy share of the wall time) and writes the
profiler's tables (the top 25 ops by device time and by the host's own time) to OUT/ft-LABEL.txt.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib import lora as lora_module  # noqa: E402
from benchmarks.measure import QWEN3_06B  # noqa: E402
from lib.parallel import clip_gradients  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from lib.optim import build_optimizers
from lib.settings import defaults

p = argparse.ArgumentParser()
p.add_argument("which", choices=["full", "lora"])
p.add_argument("--kernels", type=int, default=None, help="use_kernels 1/0 (default: the model's auto)")
p.add_argument("--compile", type=int, default=0)
p.add_argument("--lean", action="store_true", help="LoRA's adapter as the candidate change runs it")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--tiny", action="store_true")
p.add_argument("--out", default=".")
a = p.parse_args()

cuda = torch.cuda.is_available()
device = "cuda" if cuda else "cpu"
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
shape = dict(QWEN3_06B, n_layer=2, n_embd=128, n_head=4, n_kv_head=2, head_size=32, mlp_hidden=256,
             vocab_size=1000) if a.tiny else dict(QWEN3_06B)
T = 64 if a.tiny else 1024
label = a.which + ("-lean" if a.lean else "") + ("-compiled" if a.compile else "") + \
    ("" if a.kernels is None else f"-kernels{a.kernels}")

if a.lean:
    def lean(self, x):
        # under autocast the matmuls run in bf16 whatever the adapter's dtype: no fp32 copy of x on the way
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.B.dtype)
        return F.linear(F.linear(self.dropout(x), self.A) * self.scale, self.B)
    lora_module.LoRA.forward = lean

model = GPT(GPTConfig(**shape, dropout=0.0, use_kernels=None if a.kernels is None else bool(a.kernels)))
if a.which == "lora":
    model = lora_module.add_lora(model.to(torch.bfloat16), 16)  # the frozen base in bf16, the adapters fp32
model = model.to(device)
opt = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                       "learning_rate": 1e-5, "weight_decay": 0.0}, device)[0]
compiled = torch.compile(model) if a.compile else model
autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=cuda)
data = [torch.randint(0, shape["vocab_size"] - 1, (1, T + 1), device=device) for _ in range(4)]


def step(i):
    xy = data[i % len(data)]
    with autocast:
        loss = compiled(xy[:, :-1], xy[:, 1:])[1]
    loss.backward()
    clip_gradients(model, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


began = time.time()
for i in range(3):
    step(i)
warm = time.time() - began
times = []
for i in range(a.steps):
    t0 = time.perf_counter()
    step(i)
    times.append((time.perf_counter() - t0) * 1000)
med = statistics.median(times[len(times) // 3:])
peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
    for i in range(3):
        step(i)
events = prof.key_averages()
busy = sum(e.self_device_time_total for e in events) / 1000 / 3 if cuda else float("nan")  # ms a step
line = (f"{label}: {med:.1f} ms/step, {T / med * 1000:,.0f} tokens/s, peak {peak:,.0f} MB, device busy "
        f"{busy:.1f} ms a step ({busy / med:.0%}), first 3 steps {warm:.0f} s")
print(line, flush=True)
os.makedirs(a.out, exist_ok=True)
with open(os.path.join(a.out, f"ft-{label}.txt"), "w") as f:
    f.write(line + "\n\nby device time (3 steps)\n")
    f.write(events.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=25,
                         max_name_column_width=60))
    f.write("\n\nby the host's own time (3 steps)\n")
    f.write(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
