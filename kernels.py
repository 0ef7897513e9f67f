"""
Fused ops for the transformer's memory-bound work: each public op `name` beside its plain PyTorch reference
`name_ref`, of the same signature. This file imports without a GPU or Triton.

    from kernels import rms_norm, swiglu, apply_rotary, linear_cross_entropy
    y = rms_norm(x, weight, 1e-5)

The public ops run Triton kernels on CUDA tensors, and on CPU ones under TRITON_INTERPRET=1 (the CPU tests), else
the reference. Each is a torch.library custom op with a fake and a backward: torch.compile traces it as one node.
Kernels compute in fp32 (fp64 for fp64 inputs, for gradcheck).
"""

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

# Triton reads this when it is imported; after that, setting it changes nothing
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# --- references (plain PyTorch) --------------------------------------------------


def rms_norm_ref(x, weight, eps=1e-5):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def swiglu_ref(gate, up):
    return F.silu(gate) * up


def apply_rotary_ref(x, cos, sin):
    # x: (B, T, H, D); cos, sin: (T, D/2) fp32. Rotates each pair (x[i], x[i + D/2]). Rolled halves, not slices,
    # save a third of forward and backward on CPU: a roll's backward is a roll, a slice's zero-fills a new tensor.
    c, s = torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]  # (T, 1, D)
    xf = x.float()
    return (xf * c + xf.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)


def linear_cross_entropy_ref(x, weight, targets, ignore_index=-1):
    # x: (N, C), weight: (V, C), targets: (N,) -> mean loss over non-ignored targets (0, not NaN, if none).
    # All N x V logits exist at once here (twice for a half-precision x); the Triton op makes a chunk at a time.
    loss = F.cross_entropy((x @ weight.t()).float(), targets, ignore_index=ignore_index, reduction="sum")
    return loss / (targets != ignore_index).sum().clamp(min=1)


# --- public ops: the Triton versions where Triton can run them, else the references ---

rms_norm = rms_norm_ref
swiglu = swiglu_ref
apply_rotary = apply_rotary_ref
linear_cross_entropy = linear_cross_entropy_ref

# linear_cross_entropy's logits per chunk: 2**28 (0.5 GB in bf16), whose matmuls dwarf re-reading grad_weight
LCE_CHUNK_ELEMENTS = 2**28


def triton_can_run(t):
    return HAS_TRITON and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))


if HAS_TRITON:
    from torch import Tensor

    def _acc(*ts):  # the dtype kernels compute in
        return torch.float64 if any(t.dtype == torch.float64 for t in ts) else torch.float32

    def _tl(dtype):
        return tl.float64 if dtype == torch.float64 else tl.float32

    def _warps(block):
        return 4 if block <= 2048 else 8 if block <= 8192 else 16

    def _programs(t, n):  # enough programs to fill the GPU, but few for the slow interpreter
        return min(n, (4 * torch.cuda.get_device_properties(t.device).multi_processor_count) if t.is_cuda else 4)

    def _rows(t):  # (..., n) -> (M, n) with unit column stride, copying only when it must
        t = t.reshape(-1, t.shape[-1])
        return t if t.stride(1) == 1 else t.contiguous()

    # --- RMSNorm ------------------------------------------------------------------------

    @triton.jit
    def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, C, eps,
                             ROWS: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        rows, cols = r[:, None], tl.arange(0, BLOCK_C)[None, :]  # (ROWS, 1), (1, BLOCK_C)
        mask = (rows < M) & (cols < C)
        offs = rows.to(tl.int64) * C + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(ACC)
        mean_square = tl.sum(x * x, 1) / C + eps  # (ROWS,)
        if ACC == tl.float64:  # tl.rsqrt lowers to PTX's approximate rsqrt.approx.f64: too coarse for gradcheck
            rstd = 1.0 / tl.sqrt(mean_square)
        else:
            rstd = tl.rsqrt(mean_square)
        tl.store(y_ptr + offs, (x * rstd[:, None] * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + r, rstd, mask=r < M)

    @triton.jit
    def _rms_norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, M, C,
                             ROWS: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
        pid = tl.program_id(0)  # each strides over row blocks, keeping its own partial sum of dw: no atomics
        cols = tl.arange(0, BLOCK_C)[None, :]
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(ACC)
        dw = tl.zeros((1, BLOCK_C), ACC)
        for start in range(pid * ROWS, M, tl.num_programs(0) * ROWS):
            rows = start + tl.arange(0, ROWS)[:, None]
            mask = (rows < M) & (cols < C)
            offs = rows.to(tl.int64) * C + cols
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(ACC)
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(ACC)
            rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)  # (ROWS, 1)
            xhat, wdy = x * rstd, w * dy
            dx = rstd * (wdy - xhat * (tl.sum(xhat * wdy, 1)[:, None] / C))
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, 0)[None, :]
        tl.store(dw_ptr + pid * C + cols, dw, mask=cols < C)

    def _rms_norm_config(C):
        block = triton.next_power_of_2(C)
        rows = max(1, 2048 // block)
        return dict(ROWS=rows, BLOCK_C=block, num_warps=_warps(rows * block))

    @torch.library.custom_op("kernels::rms_norm", mutates_args=())
    def _rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        M, C = x2.shape
        y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd = torch.empty(M, dtype=_acc(x, weight), device=x.device)
        cfg = _rms_norm_config(C)
        _rms_norm_fwd_kernel[(triton.cdiv(M, cfg["ROWS"]),)](
            x2, weight.contiguous(), y, rstd, M, C, eps, ACC=_tl(rstd.dtype), **cfg)
        return y.view(x.shape), rstd

    @_rms_norm_op.register_fake
    def _(x, weight, eps):
        y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
        return y, x.new_empty(x.shape[:-1].numel(), dtype=_acc(x, weight))

    @torch.library.custom_op("kernels::rms_norm_backward", mutates_args=())
    def _rms_norm_bwd_op(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
        x2, dy2 = x.reshape(-1, x.shape[-1]).contiguous(), dy.reshape(-1, x.shape[-1]).contiguous()
        M, C = x2.shape
        dx = torch.empty_like(x2)
        cfg = _rms_norm_config(C)
        P = _programs(x, triton.cdiv(M, cfg["ROWS"]))
        dw_partial = torch.empty(P, C, dtype=rstd.dtype, device=x.device)
        _rms_norm_bwd_kernel[(P,)](dy2, x2, weight.contiguous(), rstd, dx, dw_partial, M, C,
                                   ACC=_tl(rstd.dtype), **cfg)
        return dx.view(x.shape), dw_partial.sum(0).to(weight.dtype)

    @_rms_norm_bwd_op.register_fake
    def _(dy, x, weight, rstd):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)  # contiguous, as the op's are

    def _rms_norm_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1], output[1])  # x, weight, rstd
        ctx.set_materialize_grads(False)  # (autograd would fill zeros as large as rstd for its gradient, every call)

    def _rms_norm_backward(ctx, dy, _):
        if dy is None:  # no gradient reached y
            return None, None, None
        return *_rms_norm_bwd_op(dy, *ctx.saved_tensors), None

    _rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)

    def rms_norm(x, weight, eps=1e-5):
        if not triton_can_run(x):
            return rms_norm_ref(x, weight, eps)
        # the shapes the kernels take for granted, checked as the references' ops check them (else a kernel reads a
        # weight's first C values, a row of a broadcast tensor past its end, the first N targets of more)
        if weight.shape != x.shape[-1:]:
            raise ValueError(f"rms_norm: weight {list(weight.shape)}, x {list(x.shape)}")
        return _rms_norm_op(x, weight, eps)[0]

    # --- SwiGLU -------------------------------------------------------------------------

    # gate and up may be strided views (slices of a wider tensor): the kernels take a row stride for each, not copies
    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, y_ptr, H, sg, su,
                           BLOCK: tl.constexpr, ACC: tl.constexpr):
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(ACC)
        u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(ACC)
        tl.store(y_ptr + row * H + cols, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, H, sdy, sg, su,
                           BLOCK: tl.constexpr, ACC: tl.constexpr):
        # recompute sigmoid(g) rather than save silu(g): one read of g is cheaper than a write
        row, cols = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        dy = tl.load(dy_ptr + row * sdy + cols, mask=mask, other=0.0).to(ACC)
        g = tl.load(g_ptr + row * sg + cols, mask=mask, other=0.0).to(ACC)
        u = tl.load(u_ptr + row * su + cols, mask=mask, other=0.0).to(ACC)
        s = tl.sigmoid(g)
        dg = dy * u * s * (1 + g * (1 - s))
        tl.store(dg_ptr + row * H + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + row * H + cols, (dy * g * s).to(du_ptr.dtype.element_ty), mask=mask)

    def _swiglu_grid(M, H):
        block = min(triton.next_power_of_2(H), 1024)
        return (M, triton.cdiv(H, block)), dict(BLOCK=block, num_warps=_warps(block))

    @torch.library.custom_op("kernels::swiglu", mutates_args=())
    def _swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
        g, u = _rows(gate), _rows(up)
        (M, H), acc = g.shape, _tl(_acc(gate, up))
        y = torch.empty(M, H, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
        grid, cfg = _swiglu_grid(M, H)
        _swiglu_fwd_kernel[grid](g, u, y, H, g.stride(0), u.stride(0), ACC=acc, **cfg)
        return y.view(gate.shape)

    @_swiglu_op.register_fake
    def _(gate, up):
        return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))

    @torch.library.custom_op("kernels::swiglu_backward", mutates_args=())
    def _swiglu_bwd_op(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        d, g, u = _rows(dy), _rows(gate), _rows(up)
        (M, H), acc = g.shape, _tl(_acc(gate, up))
        dg = torch.empty(M, H, dtype=gate.dtype, device=gate.device)
        du = torch.empty(M, H, dtype=up.dtype, device=up.device)
        grid, cfg = _swiglu_grid(M, H)
        _swiglu_bwd_kernel[grid](d, g, u, dg, du, H, d.stride(0), g.stride(0), u.stride(0), ACC=acc, **cfg)
        return dg.view(gate.shape), du.view(up.shape)

    @_swiglu_bwd_op.register_fake
    def _(dy, gate, up):
        return gate.new_empty(gate.shape), up.new_empty(up.shape)

    def _swiglu_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def _swiglu_backward(ctx, dy):
        return _swiglu_bwd_op(dy, *ctx.saved_tensors)

    _swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)

    def swiglu(gate, up):
        if not triton_can_run(gate):
            return swiglu_ref(gate, up)
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {list(gate.shape)}, up {list(up.shape)}")
        return _swiglu_op(gate, up)

    # --- rotary embeddings ----------------------------------------------------------------

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, T, H, D2, sb, st, sh, sd,
                       SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                       ACC: tl.constexpr):
        pid = tl.program_id(0)  # one per token (b, t), its heads sharing a row of cos and sin; x may be strided, y not
        b, t = pid // T, pid % T
        h, d = tl.arange(0, BLOCK_H)[:, None], tl.arange(0, BLOCK_D)[None, :]
        mask = (h < H) & (d < D2)
        c = tl.load(cos_ptr + t * D2 + d, mask=d < D2, other=0.0).to(ACC)
        s = tl.load(sin_ptr + t * D2 + d, mask=d < D2, other=0.0).to(ACC) * SIGN
        xp = x_ptr + b.to(tl.int64) * sb + t.to(tl.int64) * st + h * sh + d * sd
        x1 = tl.load(xp, mask=mask, other=0.0).to(ACC)
        x2 = tl.load(xp + D2 * sd, mask=mask, other=0.0).to(ACC)
        yp = y_ptr + pid.to(tl.int64) * H * 2 * D2 + h * 2 * D2 + d
        tl.store(yp, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(yp + D2, (x1 * s + x2 * c).to(y_ptr.dtype.element_ty), mask=mask)

    def _rotary_config(H, D):
        block_h, block_d = triton.next_power_of_2(H), triton.next_power_of_2(D // 2)
        return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=_warps(block_h * block_d))

    @torch.library.custom_op("kernels::rotary", mutates_args=())
    def _rotary_op(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
        B, T, H, D = x.shape
        torch._check(cos.shape == (T, D // 2) and sin.shape == (T, D // 2) and D % 2 == 0)
        y = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
        _rotary_kernel[(B * T,)](x, cos.contiguous(), sin.contiguous(), y, T, H, D // 2, *x.stride(),
                                 SIGN=-1.0 if inverse else 1.0, ACC=_tl(_acc(x)), **_rotary_config(H, D))
        return y

    @_rotary_op.register_fake
    def _(x, cos, sin, inverse):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    def _rotary_setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[1], inputs[2])
        ctx.inverse = inputs[3]

    def _rotary_backward(ctx, dy):
        return _rotary_op(dy, *ctx.saved_tensors, not ctx.inverse), None, None, None  # the opposite rotation

    _rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)

    def apply_rotary(x, cos, sin):
        if not triton_can_run(x):
            return apply_rotary_ref(x, cos, sin)
        # the kernel reads row t of cos and sin for position t: a longer table must be sliced to T rows (the op's
        # torch._check said only "Expected cond to be True"); and it makes no gradient for cos or sin (None, silently)
        if x.dim() != 4 or x.shape[-1] % 2 or cos.shape != (x.shape[1], x.shape[-1] // 2) or sin.shape != cos.shape:
            raise ValueError(f"apply_rotary: x {list(x.shape)}, cos {list(cos.shape)}, sin {list(sin.shape)}")
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            raise ValueError("apply_rotary: cos and sin require grad, which the kernel does not make")
        return _rotary_op(x, cos, sin, False)

    # --- linear + cross-entropy -----------------------------------------------------------

    @triton.jit
    def _cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, scale_ptr, V, stride,
                              ignore_index, BLOCK: tl.constexpr, ACC: tl.constexpr):
        # per row: loss = logsumexp(z) - z[target], and z becomes its gradient (softmax(z) - onehot(target)) * scale
        row = tl.program_id(0)
        ptr = logits_ptr + row.to(tl.int64) * stride
        target = tl.load(targets_ptr + row)
        valid = target != ignore_index
        z_target = tl.load(ptr + tl.where(valid, target, 0)).to(ACC)
        cols = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), ACC)  # online softmax: running max and sum of exp
        d = tl.zeros((), ACC)
        for start in range(0, V, BLOCK):
            z = tl.load(ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(ACC)
            m_new = tl.maximum(m, tl.max(z, 0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of -inf alone: exp(-inf - -inf) is NaN
            d = d * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), 0)
            m = m_new
        log_d = tl.log(d)  # logsumexp(z) = m + log_d, kept apart: their sum rounds at z's size (1e-4 at z ~ 1,000)
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK):
            z = tl.load(ptr + start + cols, mask=start + cols < V, other=0.0).to(ACC)
            g = (tl.exp((z - m) - log_d) - tl.where(start + cols == target, 1.0, 0.0)) * scale
            tl.store(ptr + start + cols, g.to(logits_ptr.dtype.element_ty), mask=start + cols < V)
        tl.store(loss_ptr + row, tl.where(valid, (m - z_target) + log_d, 0.0))

    def _cross_entropy_config(V):
        block = min(triton.next_power_of_2(V), 4096)
        return dict(BLOCK=block, num_warps=_warps(block))

    @torch.library.custom_op("kernels::linear_cross_entropy", mutates_args=())
    def _lce_op(x: Tensor, weight: Tensor, targets: Tensor, ignore_index: int,
                x_grad: bool, w_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
        # -> (loss, grad_x, grad_weight): the gradients made here, a chunk at a time while its logits exist (backward
        # only scales them), each empty where not wanted (a frozen head under LoRA: no V x C matmul or buffer)
        N, V, acc = x.shape[0], weight.shape[0], _acc(x, weight)
        targets = targets.contiguous()
        # a target past the vocabulary would be read from another row's logits (the reference raises): on CUDA a
        # device-side assert, with no sync
        torch._assert_async(((targets == ignore_index) | ((targets >= 0) & (targets < V))).all(),
                            "linear_cross_entropy: a target outside [0, vocab_size) that is not ignore_index")
        n_valid = (targets != ignore_index).sum().clamp(min=1)  # stays on device: no sync
        scale = 1.0 / n_valid.to(acc)
        loss_rows = torch.empty(N, dtype=acc, device=x.device)
        grad_x = torch.empty_like(x) if x_grad else x.new_empty(0)
        grad_w = None if w_grad else weight.new_empty(0)
        rows = max(1, triton.cdiv(N, max(1, triton.cdiv(N * V, LCE_CHUNK_ELEMENTS))))  # a chunk's, as few as fit
        cfg = _cross_entropy_config(V)
        for s in range(0, N, rows):
            xc = x[s:s + rows]
            logits = xc @ weight.t()  # (rows, V), in x's dtype: the Triton kernel reads it in fp32
            _cross_entropy_kernel[(xc.shape[0],)](logits, targets[s:], loss_rows[s:], scale, V,
                                                  logits.stride(0), ignore_index, ACC=_tl(acc), **cfg)
            if x_grad:  # logits now hold d(loss)/d(logits)
                torch.mm(logits, weight, out=grad_x[s:s + rows])
            if w_grad:
                # in weight's dtype: an fp32 copy would cost twice the weight (2 GB at V=128K, C=4096), more
                # than chunking saves; cuBLAS sums each chunk in fp32 and rounds once per chunk, so bf16's error
                # grows with the chunks (16 for 32K tokens at V=128K; 32 chunks: 1.1e-2 relative, 4x the plain op's)
                grad_w = logits.t() @ xc if grad_w is None else grad_w.addmm_(logits.t(), xc)
        return loss_rows.sum() * scale, grad_x, torch.zeros_like(weight) if grad_w is None else grad_w  # (no rows)

    @_lce_op.register_fake
    def _(x, weight, targets, ignore_index, x_grad, w_grad):
        return (x.new_empty((), dtype=_acc(x, weight)), torch.empty_like(x) if x_grad else x.new_empty(0),
                weight.new_empty(weight.shape) if w_grad else weight.new_empty(0))  # (a matmul's: contiguous)

    def _lce_setup(ctx, inputs, output):
        ctx.save_for_backward(output[1], output[2])
        ctx.set_materialize_grads(False)  # else autograd fills zeros as large as the gradient outputs, every call

    def _lce_backward(ctx, dloss, _dgx, _dgw):
        if dloss is None:  # no gradient reached the loss
            return (None,) * 6
        # out of place: scaling the saved gradients in place would break a second backward. dloss is rounded to their
        # dtype: a bf16 run's gradients all scaled by at most 1 + 2^-9 (loss / grad_accum's 1/3, not a power of 2)
        grads = [g * dloss.to(g.dtype) if g.numel() else None for g in ctx.saved_tensors]
        return *grads, None, None, None, None

    _lce_op.register_autograd(_lce_backward, setup_context=_lce_setup)

    def linear_cross_entropy(x, weight, targets, ignore_index=-1):
        if not triton_can_run(x):
            return linear_cross_entropy_ref(x, weight, targets, ignore_index)
        if targets.shape != x.shape[:1]:
            raise ValueError(f"linear_cross_entropy: {targets.numel()} targets for {x.shape[0]} rows")
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # autocast would cast the reference's matmul, not our op
            x, weight = x.to(torch.get_autocast_dtype(dev)), weight.to(torch.get_autocast_dtype(dev))
        if x.dtype == torch.float16 or weight.dtype == torch.float16:
            # the gradients are made in forward, before the loss scale is known: fp16 would underflow small ones
            x, weight = x.float(), weight.float()
        grad = torch.is_grad_enabled()
        with torch.autocast(dev, enabled=False):  # inputs are cast already: the op's matmuls keep them
            return _lce_op(x, weight, targets, ignore_index, grad and x.requires_grad,
                           grad and weight.requires_grad)[0]

    # --- every launch at a model's shape ----------------------------------------------------

    def launches(n_embd, mlp_hidden, n_head, n_kv_head, head_size, vocab_size):
        """[(kernel, launch parameters)] of every kernel the model launches at this shape (ACC and SIGN aside), as the
        wrappers choose them: tests/test_kernels.py compiles them for a GPU's architecture without one."""
        found = []
        for C in (n_embd, head_size):  # the blocks' norms, and qk_norm's over each head
            found += [(k, _rms_norm_config(C)) for k in (_rms_norm_fwd_kernel, _rms_norm_bwd_kernel)]
        found += [(k, _swiglu_grid(1, mlp_hidden)[1]) for k in (_swiglu_fwd_kernel, _swiglu_bwd_kernel)]
        found += [(_rotary_kernel, _rotary_config(H, head_size)) for H in (n_head, n_kv_head)]
        found.append((_cross_entropy_kernel, _cross_entropy_config(vocab_size)))
        return found
