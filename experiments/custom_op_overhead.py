"""
The host's cost of calling an op through torch.library.custom_op with register_autograd, against kernels.py's
_Eager (a plain autograd.Function around the same op, setup and backward), for an op that only copies two small
tensors: what an eager step pays per fused op beside its kernels. CPU only; no Triton needed.

    python experiments/custom_op_overhead.py
"""

import os
import sys
import time

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kernels  # noqa: E402


@torch.library.custom_op("probe::copy", mutates_args=())
def copy(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    return x.clone(), w.clone()


@copy.register_fake
def _(x, w):
    return torch.empty_like(x), torch.empty_like(w)


def setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def backward(ctx, dx, dw):
    return dx, dw


copy.register_autograd(backward, setup_context=setup)
x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
calls = {"custom op": lambda: copy(x, w), "kernels._Eager": lambda: kernels._Eager.apply(copy, setup, backward, x, w),
         "no op (clone)": lambda: (x.clone(), w.clone())}
for name, call in calls.items():
    for _ in range(100):
        call()
    n, began = 1000, time.perf_counter()
    for _ in range(n):
        a, b = call()
        (a.sum() + b.sum()).backward()
    print(f"{name}: {(time.perf_counter() - began) / n * 1e6:.0f} us a forward and backward")
