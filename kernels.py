"""
Fused ops for the transformer's memory-bound work, each beside its plain PyTorch reference.

    from kernels import rms_norm, swiglu, apply_rotary, linear_cross_entropy
    y = rms_norm(x, weight, 1e-5)

Every public op `name` has a reference `name_ref` with the same signature. This file imports
cleanly on a machine with neither a GPU nor Triton.
"""

import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# references (plain PyTorch)


def rms_norm_ref(x, weight, eps=1e-5):
    # normalise in fp32 whatever the input dtype, then scale in the input dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def swiglu_ref(gate, up):
    return F.silu(gate) * up


def apply_rotary_ref(x, cos, sin):
    # x: (B, T, H, D); cos, sin: (T, D/2) fp32. Rotates the pair (x[i], x[i + D/2]).
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, D/2), broadcast over heads
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).to(x.dtype)


def linear_cross_entropy_ref(x, weight, targets, ignore_index=-1):
    # x: (N, C), weight: (V, C), targets: (N,) -> mean cross-entropy over non-ignored targets.
    # A batch where every target is ignored gives 0 (not NaN) and zero gradients.
    logits = (x @ weight.t()).float()  # (N, V)
    loss = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    return loss / (targets != ignore_index).sum().clamp(min=1)


# -----------------------------------------------------------------------------
# public ops: the Triton versions take over these names when Triton can run them

rms_norm = rms_norm_ref
swiglu = swiglu_ref
apply_rotary = apply_rotary_ref
linear_cross_entropy = linear_cross_entropy_ref
