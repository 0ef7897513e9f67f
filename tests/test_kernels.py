"""
kernels.py: every Triton op against its plain PyTorch reference, forward and backward.

    python -m pytest -q tests/test_kernels.py

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
switches it on). It costs milliseconds per program instance, so the shapes here are small;
they are still odd on purpose: widths that are not powers of two, rows that do not fill the
last block.
"""

import math
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import kernels as K
from helpers import TINY, new_python

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    not K.triton_can_run(torch.empty(0, device=DEVICE)),
    reason="Triton cannot run here: not installed, or no GPU and TRITON_INTERPRET unset",
)
# fp32: relative error; fp16/bf16: two ulps (the interpreter truncates fp32->bf16 stores)
TOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}
DTYPES = list(TOL)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rel_err(a, b):
    # max error relative to the largest reference value: elementwise relative error is
    # meaningless where a gradient cancels to nearly zero
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def fwd_bwd(fn, inputs, seed=0):
    # run fn and its backward on fresh leaf copies of inputs (those that require grad get
    # gradients); also check that neither pass changed an input
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    before = [t.detach().clone() for t in leaves]
    out = fn(*leaves)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    out.backward(dy)
    for t, t0 in zip(leaves, before):
        assert torch.equal(t.detach(), t0), "an op changed its input"
    return out, [t.grad for t in leaves if t.requires_grad]


class KernelsCalled(TorchDispatchMode):
    # the names of kernels.py's custom ops that ran while it was on
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kernels":
            self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def check(op, ref, inputs, dtype):
    # op in `dtype` against the reference in fp32 on the same (upcast) values; op runs a kernel, not the reference
    cast = [t.to(dtype) if t.is_floating_point() and t.requires_grad else t for t in inputs]
    up = [t.float() if t.is_floating_point() and t.requires_grad else t for t in cast]
    with KernelsCalled() as called:
        out, grads = fwd_bwd(op, cast)
    assert called.names, "no kernel ran"
    out_ref, grads_ref = fwd_bwd(ref, up)
    assert out.dtype == ref(*cast).dtype
    assert rel_err(out, out_ref) <= TOL[dtype]
    for t, g, g_ref in zip([t for t in cast if t.requires_grad], grads, grads_ref):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert rel_err(g, g_ref) <= TOL[dtype]


def randn(*shape, grad=True):
    return torch.randn(*shape, device=DEVICE).requires_grad_(grad)


# -----------------------------------------------------------------------------
# each reference is what model.py computes without the kernels: the kernels are tested against the model's ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_reference_is_the_models_plain_op_bit_for_bit(dtype):
    import model
    torch.manual_seed(0)
    x, w, hidden, head = (torch.randn(*shape, dtype=dtype, requires_grad=True) for shape in [(3, 5, 2, 8), (8,),
                                                                                            (7, 8), (11, 8)])
    angles = torch.outer(torch.arange(5.0), torch.rand(4))
    targets = torch.randint(-1, 11, (7,))
    pairs = [(lambda x, w: model.rms_norm(x, w, 1e-5), lambda x, w: K.rms_norm_ref(x, w, 1e-5), [x, w]),
             (lambda x: model.apply_rotary(x, angles.cos(), angles.sin()),
              lambda x: K.apply_rotary_ref(x, angles.cos(), angles.sin()), [x]),
             (model.swiglu, K.swiglu_ref, [hidden, hidden.flip(0)]),
             (model.linear_cross_entropy, K.linear_cross_entropy_ref, [hidden, head, targets])]
    for ours, ref, inputs in pairs:
        out, grads = fwd_bwd(ours, inputs)
        out_ref, grads_ref = fwd_bwd(ref, inputs)
        assert torch.equal(out, out_ref) and all(map(torch.equal, grads, grads_ref))


def z_loss(x, weight, targets, ignore_index=-1):  # an edit of model.py's loss: a z-loss on the logits
    logits = (x @ weight.t()).float()
    kept = targets != ignore_index
    return (F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
            + 1e-4 * (torch.logsumexp(logits, -1)[kept] ** 2).sum()) / kept.sum().clamp(min=1)


@pytest.mark.parametrize("name,edit", [("linear_cross_entropy", z_loss), ("swiglu", lambda g, u: F.gelu(g) * u),
                                       ("rms_norm", lambda x, w, eps: F.layer_norm(x, x.shape[-1:], w, eps=eps))])
def test_an_edit_of_a_plain_op_that_the_kernels_fuse_is_refused_where_they_would_run(monkeypatch, name, edit):
    # where use_kernels runs kernels.py's fused ops (CUDA), model.py's plain op is not run: an edit of it alone (a
    # z-loss, GELU for SiLU, LayerNorm) would train on a CPU and not on the GPU, with nothing said. A run that will
    # fuse checks model.py's ops against the references the kernels are tested against (start.first_model)
    import model
    from lib.start import check_fused_ops
    check_fused_ops(True, "cpu")
    monkeypatch.setattr(model, name, edit)
    check_fused_ops(False, "cpu")  # (nothing fuses)
    with pytest.raises(ValueError, match=rf"^model.py's {name} computes otherwise than kernels.py's fused {name}, "
                                         rf"which runs in its place on CUDA \(use_kernels\): make the two the same"):
        check_fused_ops(True, "cpu")


def test_a_run_that_fused_read_back_after_an_edit_of_a_plain_op_is_refused(data_dir, tmp_path, monkeypatch):
    # sample.py, eval.py and export.py read a run back with its use_kernels: where that fuses, an edit of model.py's
    # op since (made on a CPU run's model, say) would be computed by the unedited fused op, and is refused instead
    import model
    from helpers import run, script
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=1")
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # a run with use_kernels=True, not trained so
    checkpoint["model_args"]["use_kernels"] = True  # (under Triton's interpreter it takes half a minute)
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    monkeypatch.setattr(model, "swiglu", lambda gate, up: F.gelu(gate) * up)
    for args in (["sample.py", "--max_new_tokens=2"], ["eval.py"]):
        done = script(*args, f"--out_dir={tmp_path}")
        assert done.returncode == 1 and "model.py's swiglu computes otherwise than kernels.py's fused swiglu" in \
            done.stderr.strip().splitlines()[-1], done.stderr[-2000:]


@pytest.mark.slow
def test_train_py_with_the_kernels_refuses_an_edit_of_a_plain_op_they_fuse(data_dir, tmp_path):
    # the same, end to end: an edit made by a config file (in train.py's process)
    (tmp_path / "zloss.py").write_text("import model as _m\n_plain = _m.linear_cross_entropy\n"
                                      "_m.linear_cross_entropy = lambda x, w, t, i=-1: _plain(x, w, t, i) + 1e-3\n")
    done = new_python("train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2",
                      "--use_kernels=True", tmp_path / "zloss.py", env={"TRITON_INTERPRET": "1"})
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(
        "train.py: model.py's linear_cross_entropy computes otherwise than kernels.py's fused"), done.stderr[-2000:]
    assert not (tmp_path / "out" / "ckpt.pt").exists()


# -----------------------------------------------------------------------------
# each op against its reference


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, eps", [((5, 17, 100), 1e-5), ((3, 260), 0.5)])
def test_rms_norm(dtype, shape, eps):
    # 85 rows of 100: more row blocks (16 rows) than the interpreter's 4 programs, so that each program sums its
    # blocks' dw; an eps as large as the mean square, where one left out shows
    torch.manual_seed(0)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).requires_grad_()
    check(lambda x, w: K.rms_norm(x, w, eps), lambda x, w: K.rms_norm_ref(x, w, eps), [randn(*shape), weight], dtype)


@needs_triton
def test_rms_norm_mixed_dtypes():
    # bf16 activations with an fp32 weight: the output promotes to fp32, as the reference's does
    torch.manual_seed(0)
    x, w = randn(2, 5, 48).to(torch.bfloat16), (1 + 0.1 * randn(48, grad=False)).requires_grad_()
    out, (gx, gw) = fwd_bwd(lambda x, w: K.rms_norm(x, w, 1e-5), [x.detach().requires_grad_(), w])
    assert out.dtype == K.rms_norm_ref(x, w, 1e-5).dtype == torch.float32
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.float32
    out_ref, (gx_ref, gw_ref) = fwd_bwd(lambda x, w: K.rms_norm_ref(x, w, 1e-5), [x.detach().float().requires_grad_(), w])
    assert rel_err(out, out_ref) <= 2**-6 and rel_err(gx, gx_ref) <= 2**-6 and rel_err(gw, gw_ref) <= 2**-6


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("views", ["halves", "one half", "contiguous"])
def test_swiglu(dtype, views):
    torch.manual_seed(0)
    if views == "halves":  # the model's layout: gate and up are the two halves of one matmul's output
        check(lambda gu: K.swiglu(*gu.chunk(2, -1)), lambda gu: K.swiglu_ref(*gu.chunk(2, -1)),
              [randn(2, 19, 200)], dtype)
    elif views == "one half":  # each takes its own row stride
        check(lambda gu, u: K.swiglu(gu.chunk(2, -1)[0], u), lambda gu, u: K.swiglu_ref(gu.chunk(2, -1)[0], u),
              [randn(2, 19, 200), randn(2, 19, 100)], dtype)
    else:  # contiguous, and wider than one block (1024) with a ragged tail
        check(K.swiglu, K.swiglu_ref, [randn(3, 1500), randn(3, 1500)], dtype)


def _rotary_qk(apply, H, Hkv, D):
    # q and k as strided views into one (B, T, (H + 2·Hkv)·D) tensor: the kernel takes any strides
    def fn(qkv, cos, sin):
        B, T, _ = qkv.shape
        q, k, _ = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k = apply(q.view(B, T, H, D), cos, sin), apply(k.view(B, T, Hkv, D), cos, sin)
        return torch.cat([q.flatten(2), k.flatten(2)], -1)
    return fn


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,Hkv,D", [(3, 1, 10), (4, 2, 16)])
def test_apply_rotary(dtype, H, Hkv, D):
    torch.manual_seed(0)
    T = 7
    angles = torch.outer(torch.arange(T, device=DEVICE).float(), torch.rand(D // 2, device=DEVICE))
    inputs = [randn(2, T, (H + 2 * Hkv) * D), angles.cos(), angles.sin()]
    check(_rotary_qk(K.apply_rotary, H, Hkv, D), _rotary_qk(K.apply_rotary_ref, H, Hkv, D), inputs, dtype)


def _targets(N, V, ignore):
    t = torch.randint(0, V, (N,), device=DEVICE)
    if ignore == "some":
        t[::3] = -1
    if ignore == "all":
        t[:] = -1
    return t


# The quick tier keeps every dtype chunked with ignored targets, and one chunk of all targets in fp32: each branch
# of the op once; the slow tier runs the rest of the product (~2-4 s each under Triton's interpreter).
LCE_QUICK = [(6, "some", dtype) for dtype in DTYPES] + [(1, "none", torch.float32)]


@needs_triton
@pytest.mark.parametrize("chunks, ignore, dtype", [
    case if case in LCE_QUICK else pytest.param(*case, marks=pytest.mark.slow)
    for case in [(chunks, ignore, dtype) for chunks in (1, 6) for ignore in ("none", "some") for dtype in DTYPES]
], ids=lambda v: str(v))
def test_linear_cross_entropy(dtype, ignore, chunks, monkeypatch):
    torch.manual_seed(0)
    N, C, V = 41, 24, 300
    if chunks > 1:
        monkeypatch.setattr(K, "LCE_CHUNK_ELEMENTS", N * V // chunks + 1)
    check(K.linear_cross_entropy, K.linear_cross_entropy_ref,
          [randn(N, C), 0.3 * randn(V, C, grad=False).requires_grad_(), _targets(N, V, ignore)], dtype)


@needs_triton
def test_linear_cross_entropy_passes_over_the_ignore_index_it_is_given():
    # -100, PyTorch's default, in place of the model's -1
    torch.manual_seed(0)
    targets = _targets(41, 300, "some")
    targets[targets == -1] = -100
    check(lambda x, w, t: K.linear_cross_entropy(x, w, t, -100),
          lambda x, w, t: K.linear_cross_entropy_ref(x, w, t, -100),
          [randn(41, 24), 0.3 * randn(300, 24, grad=False).requires_grad_(), targets], torch.float32)
@needs_triton
def test_linear_cross_entropy_with_a_frozen_head_makes_no_weight_gradient(monkeypatch):
    # LoRA freezes the head: the op makes x's gradient only, with no V x C matmul or buffer
    op, asked = K._lce_op, []
    monkeypatch.setattr(K, "_lce_op", lambda *args: asked.append(args[-2:]) or op(*args))
    torch.manual_seed(0)
    N, C, V = 41, 24, 300
    x, w, t = randn(N, C), 0.3 * randn(V, C, grad=False), _targets(N, V, "some")
    check(K.linear_cross_entropy, K.linear_cross_entropy_ref, [x, w, t], torch.float32)
    assert asked and all(a == (True, False) for a in asked)
    assert op(x.detach(), w, t, -1, True, False)[2].numel() == 0


@needs_triton
def test_linear_cross_entropy_fp16_autocast():
    # fp16 mixed precision: fp32 weights, autocast to fp16, a loss scale; as the reference does
    x, w, t = randn(33, 16), randn(70, 16), _targets(33, 70, "some")
    with torch.autocast(DEVICE, dtype=torch.float16):
        loss, (gx, gw) = fwd_bwd(lambda *a: K.linear_cross_entropy(*a) * 1024.0, [x, w, t])
        loss_ref, (gx_ref, gw_ref) = fwd_bwd(lambda *a: K.linear_cross_entropy_ref(*a) * 1024.0, [x, w, t])
    assert gx.dtype == gw.dtype == torch.float32
    assert rel_err(loss, loss_ref) <= 2**-9 and rel_err(gx, gx_ref) <= 2**-9 and rel_err(gw, gw_ref) <= 2**-9


@pytest.mark.slow  # big enough for gradients that underflow fp16 (~10-25 s under Triton's interpreter)
@needs_triton
def test_linear_cross_entropy_fp16_with_loss_scale():
    # fp16 training multiplies the loss by a scale (65536) so that small gradients survive;
    # they must survive here too, although the op makes its gradients before it sees the scale
    torch.manual_seed(0)
    N, C, V = 512, 32, 2048
    x, w, t = randn(N, C).half(), (0.3 * randn(V, C, grad=False)).half(), _targets(N, V, "some")
    grads = {}
    for name, op, args in [("op", K.linear_cross_entropy, (x, w)), ("ref", K.linear_cross_entropy_ref, (x, w)),
                           ("fp32", K.linear_cross_entropy_ref, (x.float(), w.float()))]:
        leaves = [a.detach().clone().requires_grad_() for a in args]
        (op(*leaves, t) * 65536.0).backward()
        grads[name] = [leaf.grad for leaf in leaves]
    for g, g_ref, g32 in zip(grads["op"], grads["ref"], grads["fp32"]):
        assert g.dtype == torch.float16 and torch.isfinite(g).all()
        assert rel_err(g, g32) <= max(2 * rel_err(g_ref, g32), 2**-10)  # as good as eager fp16
        assert (g == 0).float().mean() <= (g_ref == 0).float().mean() + 0.01  # nothing underflows


@needs_triton
def test_linear_cross_entropy_wide_vocab():
    # a vocabulary wider than the kernel's block (4096), with a ragged last block
    torch.manual_seed(0)
    N, C, V = 5, 8, 4500
    check(K.linear_cross_entropy, K.linear_cross_entropy_ref,
          [randn(N, C), randn(V, C), _targets(N, V, "some")], torch.float32)


@needs_triton
def test_linear_cross_entropy_with_a_first_block_of_minus_infinity():
    # a row whose first 4096 logits are -inf (an overflowed matmul, a masked vocabulary) and the rest finite: the
    # online softmax's first running max is -inf, and its loss and gradients are the plain op's, finite
    torch.manual_seed(0)
    w = randn(4100, 4)
    with torch.no_grad():
        w[:4096] = -3e38  # x . w = -inf in fp32
    x = torch.ones(2, 4, device=DEVICE, requires_grad=True)
    check(K.linear_cross_entropy, K.linear_cross_entropy_ref, [x, w, torch.tensor([4097, 4099], device=DEVICE)],
          torch.float32)


@needs_triton
def test_linear_cross_entropy_with_large_logits_is_as_close_to_float64_as_the_plain_op():
    # logits ~1,000 (fp32) and confident targets: the loss is small beside them, and logsumexp formed whole rounds at
    # the logits' size (2^-24 x 1,000), which the plain op's log_softmax (z - max first) does not
    torch.manual_seed(0)
    w, t = torch.eye(50, device=DEVICE), torch.arange(8, device=DEVICE)  # logits = x, exactly
    x = 990 + 3 * torch.randn(8, 50, device=DEVICE)
    x[range(8), t] += 15  # the target ~15 above the rest: a loss of ~0.01
    for op in (K.linear_cross_entropy, K.linear_cross_entropy_ref):
        leaf, truth_leaf = x.clone().requires_grad_(), x.double().requires_grad_()
        loss, truth = op(leaf, w, t), F.cross_entropy(truth_leaf @ w.double().t(), t)
        loss.backward(), truth.backward()
        # a few roundings of values near 1 (the sum of exps), not of ~1,000 (2^-14 each)
        assert abs(loss.item() - truth.item()) <= 2**-20 and rel_err(leaf.grad, truth_leaf.grad) <= TOL[torch.float32]


@needs_triton
@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA a device-side assert, which ends the process's CUDA context")
def test_linear_cross_entropy_refuses_a_target_outside_the_vocabulary():
    # it would read another row's logits (or past the buffer) for its loss; the plain op raises
    x, w = randn(4, 8), randn(30, 8)
    for bad in (30, -100):
        with pytest.raises(RuntimeError, match="outside"):
            K.linear_cross_entropy(x, w, torch.tensor([1, 2, bad, -1], device=DEVICE))


@needs_triton
def test_linear_cross_entropy_of_no_rows_is_the_plain_ops():
    x, w = randn(0, 8), randn(30, 8)
    loss = K.linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(w.grad, torch.zeros_like(w))


@needs_triton
def test_linear_cross_entropy_all_ignored():
    x, w = randn(7, 8), randn(30, 8)
    loss = K.linear_cross_entropy(x, w, _targets(7, 30, "all"))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))


@needs_triton
def test_linear_cross_entropy_no_grad():
    # without autograd the op skips the gradient matmuls; the loss must not change
    x, w, t = randn(9, 8), randn(30, 8), _targets(9, 30, "some")
    with torch.no_grad():
        loss = K.linear_cross_entropy(x, w, t)
    assert loss.grad_fn is None
    assert rel_err(loss, K.linear_cross_entropy_ref(x, w, t)) <= 1e-5


@needs_triton
def test_linear_cross_entropy_autocast():
    # under autocast the reference's matmul runs in bf16; the op must do the same, and hand
    # fp32 weights fp32 gradients
    x, w, t = randn(9, 16), randn(40, 16), _targets(9, 40, "some")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss, (gx, gw) = fwd_bwd(K.linear_cross_entropy, [x, w, t])
        loss_ref, (gx_ref, gw_ref) = fwd_bwd(K.linear_cross_entropy_ref, [x, w, t])
    assert loss.dtype == loss_ref.dtype == torch.float32 and gx.dtype == gw.dtype == torch.float32
    assert rel_err(loss, loss_ref) <= 2**-7
    assert rel_err(gx, gx_ref) <= 2**-6 and rel_err(gw, gw_ref) <= 2**-6


@needs_triton
def test_shapes_the_references_refuse_are_refused_by_the_kernels_too():
    # a kernel takes its shapes for granted: it read a weight's first C values, a broadcast row past its end, the
    # first N of more targets (a loss divided by the count of all of them), where the reference raises
    with torch.no_grad():
        for call, said in [(lambda: K.rms_norm(randn(3, 5), randn(8), 1e-5), "rms_norm: weight [8], x [3, 5]"),
                           (lambda: K.swiglu(randn(4, 6), randn(1, 6)), "swiglu: gate [4, 6], up [1, 6]"),
                           (lambda: K.linear_cross_entropy(randn(6, 8), randn(20, 8),
                                                           torch.zeros(12, dtype=torch.long, device=DEVICE)),
                            "linear_cross_entropy: 12 targets for 6 rows")]:
            with pytest.raises(ValueError, match=re.escape(said)):
                call()


@needs_triton
def test_apply_rotary_refuses_tables_of_another_shape_in_one_line():
    # cos, sin must be (T, D/2): a cache's table longer or shorter than T, a D/2 off by one, an odd D, an x not 4-D.
    # The op said only "Expected cond to be True" (torch._check), or failed to unpack x's shape
    x, c = randn(2, 5, 3, 8, grad=False), randn(5, 4, grad=False)
    for call, said in [(lambda: K.apply_rotary(x, randn(9, 4, grad=False), randn(9, 4, grad=False)),
                        "apply_rotary: x [2, 5, 3, 8], cos [9, 4], sin [9, 4]"),
                       (lambda: K.apply_rotary(x, randn(3, 4, grad=False), randn(3, 4, grad=False)),
                        "apply_rotary: x [2, 5, 3, 8], cos [3, 4], sin [3, 4]"),
                       (lambda: K.apply_rotary(x, c, randn(5, 3, grad=False)),
                        "apply_rotary: x [2, 5, 3, 8], cos [5, 4], sin [5, 3]"),
                       (lambda: K.apply_rotary(randn(2, 5, 3, 7, grad=False), randn(5, 3, grad=False),
                                               randn(5, 3, grad=False)),
                        "apply_rotary: x [2, 5, 3, 7], cos [5, 3], sin [5, 3]"),
                       (lambda: K.apply_rotary(randn(5, 3, 8, grad=False), c, c),
                        "apply_rotary: x [5, 3, 8], cos [5, 4], sin [5, 4]")]:
        with pytest.raises(ValueError, match=re.escape(said)):
            call()


@needs_triton
def test_apply_rotary_refuses_cos_and_sin_that_require_grad():
    # the reference differentiates cos and sin (a learned table); the op's backward gave them None, silently
    cos, sin = randn(5, 4), randn(5, 4)
    with pytest.raises(ValueError, match="apply_rotary: cos and sin require grad"):
        K.apply_rotary(randn(2, 5, 3, 8), cos, sin)
    x = randn(2, 5, 3, 8, grad=False)
    with torch.no_grad():  # no gradient asked for: the kernel runs
        assert rel_err(K.apply_rotary(x, cos, sin), K.apply_rotary_ref(x, cos, sin)) <= TOL[torch.float32]


# -----------------------------------------------------------------------------
# gradients in fp64, and the custom ops' registrations


GRADCHECKS = {  # tiny odd shapes; the kernels compute in fp64 for fp64 inputs
    "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-5), lambda: [randn(2, 3, 5), randn(5)]),
    "swiglu": (lambda gu: K.swiglu(*gu.chunk(2, -1)), lambda: [randn(3, 10)]),
    "apply_rotary": (_rotary_qk(K.apply_rotary, 2, 1, 6),
                     lambda: [randn(1, 3, 24), randn(3, 3, grad=False), randn(3, 3, grad=False)]),
    "linear_cross_entropy": (K.linear_cross_entropy,
                             lambda: [randn(5, 3), randn(7, 3), torch.tensor([0, -1, 6, 2, 2], device=DEVICE)]),
}


@needs_triton
@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_a_backward_fills_no_zeros_for_outputs_nothing_differentiates(name):
    # rms_norm's 1/rms and the fused loss's two gradients are outputs of their ops that no gradient reaches: autograd
    # fills zeros as large as each before the backward unless told not to (for the loss, the size of x and of the
    # head's weight, at every step)
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    fn, make = GRADCHECKS[name]
    if name == "apply_rotary":  # q alone (split's backward fills zeros for the parts of qkv left out)
        fn, make = K.apply_rotary, lambda: [randn(1, 3, 2, 6), randn(3, 3, grad=False), randn(3, 3, grad=False)]
    inputs = make()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*inputs).sum().backward()
    assert all(t.grad is not None for t in inputs if t.requires_grad)
    assert not [e.key for e in prof.key_averages() if e.key in ("aten::zeros", "aten::zeros_like", "aten::zero_")]


@pytest.mark.slow
@needs_triton
@pytest.mark.parametrize("name", list(GRADCHECKS))
def test_gradcheck(name):
    torch.manual_seed(0)
    fn, make = GRADCHECKS[name]
    inputs = [t.detach().double().requires_grad_(t.requires_grad) if t.is_floating_point() and t.requires_grad
              else t for t in make()]
    # fast mode compares the analytical and numerical Jacobians projected on random vectors instead of whole:
    # a wrong gradient still fails it, in a few kernel launches where the whole Jacobian took hundreds (one per
    # input and output element, each ~0.1 s under Triton's interpreter)
    assert torch.autograd.gradcheck(fn, inputs, fast_mode=True)


@pytest.mark.slow
@needs_triton
def test_opcheck():
    # schema, fake (meta) implementation, autograd registration, AOT dispatch: what
    # torch.compile relies on to trace the ops without graph breaks
    x, w = randn(3, 5, 7), randn(7)
    cases = [
        (K._rms_norm_op, (x, w, 1e-5)),
        (K._rms_norm_bwd_op, (randn(3, 5, 7, grad=False), x.detach(), w.detach(), torch.rand(15, device=DEVICE))),
        (K._swiglu_op, (x[..., :3], x[..., 4:])),
        (K._swiglu_bwd_op, (randn(3, 5, 3, grad=False), x.detach()[..., :3], x.detach()[..., 4:])),
        (K._rotary_op, (randn(2, 3, 2, 6), randn(3, 3, grad=False), randn(3, 3, grad=False), False)),
        (K._lce_op, (randn(9, 4), randn(11, 4), _targets(9, 11, "some"), -1, True, True)),
        (K._lce_op, (randn(9, 4), randn(11, 4, grad=False), _targets(9, 11, "some"), -1, True, False)),
        (K._lce_op, (randn(9, 4, grad=False), randn(11, 4, grad=False), _targets(9, 11, "none"), -1, False, False)),
    ]
    for op, args in cases:
        results = torch.library.opcheck(op, args)
        assert all(r == "SUCCESS" for r in results.values()), (op, results)


@pytest.mark.slow
@needs_triton
def test_compile_fullgraph():
    # all four ops inside one torch.compile(fullgraph=True) region: a graph break would raise
    torch.manual_seed(0)
    B, T, H, D, V = 2, 5, 2, 6, 50
    C = H * D

    def step(ops, x, w_norm, w_qk, w_gu, w_out, w_head, cos, sin, targets):
        h = ops.rms_norm(x, w_norm, 1e-5)
        q, k = (h @ w_qk.t()).split([C, C], -1)
        q, k = ops.apply_rotary(q.view(B, T, H, D), cos, sin), ops.apply_rotary(k.view(B, T, H, D), cos, sin)
        h = h + (q * k).view(B, T, C)
        h = h + ops.swiglu(*(h @ w_gu.t()).chunk(2, -1)) @ w_out.t()
        return ops.linear_cross_entropy(h.view(-1, C), w_head, targets.view(-1), ignore_index=-1)

    class Ops:  # the public ops, and the references, as the model picks them
        rms_norm, swiglu, apply_rotary, linear_cross_entropy = (
            K.rms_norm, K.swiglu, K.apply_rotary, K.linear_cross_entropy)

    class Refs:
        rms_norm, swiglu, apply_rotary, linear_cross_entropy = (
            K.rms_norm_ref, K.swiglu_ref, K.apply_rotary_ref, K.linear_cross_entropy_ref)

    params = [randn(B, T, C), 1 + 0.1 * randn(C), 0.3 * randn(2 * C, C), 0.3 * randn(4 * C, C),
              0.3 * randn(C, 2 * C), randn(V, C)]
    params = [p.detach().requires_grad_() for p in params]
    angles = torch.outer(torch.arange(T, device=DEVICE).float(), torch.rand(D // 2, device=DEVICE))
    targets = torch.randint(0, V, (B, T), device=DEVICE)
    targets[0, :2] = -1
    rest = (angles.cos(), angles.sin(), targets)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(Ops, *params, *rest)
    grads = torch.autograd.grad(loss, params)
    loss_ref = step(Refs, *params, *rest)
    grads_ref = torch.autograd.grad(loss_ref, params)
    assert rel_err(loss, loss_ref) <= 1e-5
    for g, g_ref in zip(grads, grads_ref):
        assert rel_err(g, g_ref) <= 1e-5


@pytest.mark.slow
@needs_triton
def test_model_training_matches_reference(monkeypatch):
    # a few AdamW steps of a small GPT with the fused ops and with model.py's plain ones. One layer of 8 positions:
    # every op runs forward and backward all the same, and under Triton's interpreter the time goes with the rotary
    # kernel's programs, one per position and layer (two layers of 16 took four times as long)
    from model import GPT, GPTConfig
    ops, called = ("rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy"), []
    for name in ops:  # each fused op counted when called: the same losses alone cannot tell which ops ran
        monkeypatch.setattr(K, name, lambda *args, name=name, op=getattr(K, name): called.append(name) or op(*args))

    def train(use_kernels):
        called.clear()
        torch.manual_seed(0)
        config = GPTConfig(block_size=8, vocab_size=96, n_layer=1, n_head=4, n_kv_head=2, n_embd=32,
                           dropout=0.0, use_kernels=use_kernels)
        model = GPT(config).to(DEVICE)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for step in range(4):
            data = torch.randint(0, 96, (2, 9), generator=gen).to(DEVICE)
            x, y = data[:, :-1], data[:, 1:].clone()
            y[0, :3] = -1  # ignored positions, as padding would be
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            losses.append(model(x, y)[1].item())
        assert set(called) == (set(ops) if use_kernels else set()), (use_kernels, set(called))
        return torch.tensor(losses)

    fused, ref = train(True), train(False)
    assert fused[-1] < fused[0]  # it learns
    assert rel_err(fused, ref) <= 1e-4, (fused, ref)


# Compiles every kernel for an H100 (sm_90) and an A100 (sm_80) with Triton's own ptxas, at the launch
# parameters kernels.launches gives the model's real shapes: no GPU needed, so type and lowering errors
# that the interpreter cannot see show up on CPU too, and so do kernels too big for the GPU, which would
# only fail at launch. ptxas -v reports each compiled kernel's registers, spills and static shared memory;
# the script prints one line per kernel: arch, name, dtype, launch parameters, registers, spill bytes,
# shared bytes, warps.
COMPILE_FOR_CUDA = """
import re, subprocess, sys, tempfile
import triton, triton.language as tl, kernels as K
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
shapes = [  # n_embd, mlp_hidden, n_head, n_kv_head, head_size, vocab_size
    (768, 3072, 12, 12, 64, 50304),  # GPT-2 124M
    (1024, 3072, 16, 8, 128, 151936),  # Qwen3-0.6B
    (2048, 8192, 32, 8, 64, 128256),  # Llama-3.2-1B
    (4096, 14336, 32, 8, 128, 128256),  # Llama-3.1-8B
    (8192, 28672, 64, 8, 128, 128256),  # Llama-3.1-70B
]
special = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "targets_ptr": "*i64", "eps": "fp32"}
accumulated = ("rstd_ptr", "dw_ptr", "loss_ptr", "scale_ptr")


def compile_for(arch, fn, params, dt, acc):
    consts = {k: v for k, v in params.items() if k != "num_warps"}
    consts["ACC"] = tl.float64 if acc == "fp64" else tl.float32
    if "SIGN" in fn.arg_names:
        consts["SIGN"] = -1.0
    sig = {n: "constexpr" if n in consts else special.get(n, f"*{acc}" if n in accumulated
           else f"*{dt}" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
    options = dict(num_warps=params["num_warps"])
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm["cubin"]
    # fp64 is gradcheck's precision: in fp64 tl.rsqrt lowers to PTX's approximate rsqrt.approx.f64, which
    # would fail it on a GPU
    approx = re.findall(r"rsqrt\\.approx(?:\\.ftz)?\\.f64", compiled.asm["ptx"])
    assert not approx, f"{fn.__name__} computes fp64 with an approximate rsqrt: {sorted(set(approx))}"
    with tempfile.TemporaryDirectory() as tmp:  # Triton's cache keeps no ptxas log: ask ptxas again
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(compiled.asm["ptx"])
        gpu = sm_arch_from_capability(arch)
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}", f"{tmp}/k.ptx",
               "-o", f"{tmp}/k.o"]  # as Triton runs it
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    regs = int(log.split("Used ")[1].split()[0])
    spills = int(log.split("bytes spill stores")[0].split()[-1])
    static = int(log.split("bytes smem")[0].split()[-1]) if "bytes smem" in log else 0
    return regs, spills, static + compiled.metadata.shared


# bf16 (a GPU run's) for both; fp32 for the H100; fp16 and fp64 (gradcheck's) at the smallest shape
cases = [(90, "bf16", "fp32"), (80, "bf16", "fp32"), (90, "fp32", "fp32")]
done = set()
for i, shape in enumerate(shapes):
    for fn, params in K.launches(*shape):
        for arch, dt, acc in cases + ([(90, "fp16", "fp32"), (90, "fp64", "fp64")] if i == 0 else []):
            key = (arch, fn.__name__, dt, tuple(sorted(params.items())))
            if key not in done:
                done.add(key)
                regs, spills, shared = compile_for(arch, fn, params, dt, acc)
                print(arch, fn.__name__, dt, str(dict(sorted(params.items()))).replace(" ", ""), regs, spills,
                      shared, params["num_warps"])
"""
# per block: the most shared memory a kernel may use (an SM's 228 KB on an H100 and 164 KB on an A100, less
# the 1 KB CUDA reserves per block), and the registers of the block's threads together
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
REGISTERS_PER_BLOCK = 65536


@pytest.mark.slow
@pytest.mark.skipif(not K.HAS_TRITON, reason="needs Triton")
def test_kernels_compile_for_cuda_at_the_models_shapes():
    # (with a GPU too: the other tests launch the kernels at small shapes, on one architecture)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real JIT functions
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run([sys.executable, "-c", COMPILE_FOR_CUDA], cwd=REPO, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert len(lines) >= 40  # every kernel, at several block sizes, for both architectures
    for line in lines:
        arch, name, dtype, *params = line.split(" ")
        regs, spills, shared, warps = map(int, params[-4:])
        assert shared <= SHARED_LIMIT[int(arch)], f"too much shared memory: {line}"
        # registers are given out per warp in units of 256: a thread's count is rounded up to a multiple of 8
        assert -(-regs // 8) * 8 * 32 * warps <= REGISTERS_PER_BLOCK, f"too many registers: {line}"
        if spills:
            warnings.warn(f"registers spilled to local memory: {line}")


# -----------------------------------------------------------------------------
# falling back to the references


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter switch only matters for CPU tensors")
def test_cpu_without_interpreter_uses_references(monkeypatch):
    monkeypatch.setattr(K, "INTERPRET", False)
    for name in ["rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy"]:
        monkeypatch.setattr(K, name + "_ref", lambda *args, **kwargs: "ref")
    x = torch.randn(2, 3, 2, 4)
    assert K.rms_norm(x, torch.ones(4), 1e-5) == "ref"
    assert K.swiglu(x, x) == "ref"
    assert K.apply_rotary(x, torch.ones(3, 2), torch.zeros(3, 2)) == "ref"
    assert K.linear_cross_entropy(x.view(-1, 4), torch.randn(5, 4), torch.zeros(12, dtype=torch.long)) == "ref"


@pytest.mark.slow
def test_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, kernels\n"
        "assert not kernels.HAS_TRITON\n"
        "for n in ['rms_norm', 'swiglu', 'apply_rotary', 'linear_cross_entropy']:\n"
        "    assert getattr(kernels, n) is getattr(kernels, n + '_ref'), n\n"
        "x = torch.randn(2, 3, 8, requires_grad=True)\n"
        "kernels.rms_norm(x, torch.ones(8), 1e-5).sum().backward()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@needs_triton
def test_each_custom_op_fake_gives_the_real_ops_shapes_and_dtypes():
    # torch.library.opcheck runs an op for real and on fake tensors (what torch.compile traces with), and checks
    # the two agree on shapes, dtypes and strides, and that its schema and autograd registration hold
    B, T, H, D, V = 2, 4, 2, 8, 40
    x, w = randn(B * T, H * D, grad=False), randn(H * D, grad=False)
    _, rstd = K._rms_norm_op(x, w, 1e-5)
    dy = randn(B * T, H * D, grad=False)
    gate, up = randn(B * T, 16, grad=False), randn(B * T, 16, grad=False)
    qk = randn(B, T, H, D, grad=False)
    angles = torch.outer(torch.arange(T, device=DEVICE).float(), torch.rand(D // 2, device=DEVICE))
    head, targets = randn(V, H * D, grad=False), torch.randint(0, V, (B * T,), device=DEVICE)
    cases = [(K._rms_norm_op, (x, w, 1e-5)), (K._rms_norm_bwd_op, (dy, x, w, rstd)), (K._swiglu_op, (gate, up)),
             (K._swiglu_bwd_op, (randn(B * T, 16, grad=False), gate, up)),
             (K._rotary_op, (qk, angles.cos(), angles.sin(), False)),
             (K._lce_op, (x, head, targets, -1, True, True)),
             # transposed inputs: the gradients come out contiguous all the same, and the fakes must say so
             (K._rms_norm_bwd_op, (dy, x.t().contiguous().t(), w, rstd)),
             (K._lce_op, (x, head.t().contiguous().t(), targets, -1, True, True))]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@needs_triton
@pytest.mark.parametrize("use_kernels", [True, False])
def test_a_compiled_training_step_has_no_graph_break_and_no_recompile(use_kernels):
    # the model as train.py compiles it, traced whole (fullgraph: a graph break raises) through AOTAutograd, which
    # runs the fused ops' fake implementations and their backward; three steps of new batches recompile nothing
    # (torch's config.patch, not monkeypatch: undoing a ConfigModule attribute deletes it for the process)
    import torch._dynamo

    from model import GPT, GPTConfig
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=32,
                          use_kernels=use_kernels)).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # no code generated: fast on a CPU
    losses = []
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            idx = torch.randint(0, 64, (2, 9), device=DEVICE)
            _, loss = compiled(idx[:, :-1], idx[:, 1:])
            loss.backward()
            losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and all(p.grad is not None for p in model.parameters())
