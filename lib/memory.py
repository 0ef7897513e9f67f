"""
Memory: what one training process holds, estimated from the model's shapes and a trace of its forward on fake
tensors (a meta-device model will do): to plan a run (bench.py --mode=memory), choose its micro-batch
(batch_size='auto': micro_batch.py) and compare with torch.cuda.max_memory_allocated (train.py, before step 1).
"""

import dataclasses
import math
import os
import re
import resource
import sys
import weakref
from collections import Counter
from functools import partial
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lib.optim import build_optimizers
from lib.parallel import SPLIT_BY_INPUT, SPLIT_BY_OUTPUT, is_dtensor
from lib.settings import defaults
from model import PROJECTIONS

# tensor parallel splits these by output rows (attention by heads, the MLP by width), the ones after by input columns
COLUMN_PARALLEL = tuple(f"{PROJECTIONS[n]}.{kind}" for n in SPLIT_BY_OUTPUT for kind in ("weight", "bias"))
ROW_PARALLEL = tuple(f"{PROJECTIONS[n]}.weight" for n in SPLIT_BY_INPUT)
MEMORY_KINDS = ("weights", "grads", "optimizer", "activations", "copies", "temporary", "device", "host")


def tensor_bytes(t):
    # a tensor's own bytes; a tensor subclass (torchao's NF4) is the sum of the tensors it is made of
    if hasattr(t, "__tensor_flatten__") and type(t) is not nn.Parameter:
        return sum(tensor_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])
    return t.numel() * t.element_size()


def nf4_bytes(n):
    # n values in NF4 as quantize_base holds them: 4 bits each, an int8 scale per 64, an fp32 scale
    # per 256 of those, their mean and the 16-entry table
    return n // 2 + n // 64 + 4 * (n // 64 // math.gcd(256, n // 64)) + 4 + 64


def memory_estimate(model, batch_size, block_size, dtype="float32", optimizer="adamw", dp=1, tp=1, fsdp=False,
                    checkpointing=False, offload=False, quantized=None, micro_steps=1, device="cuda"):
    """Bytes one training process holds for micro-batches of batch_size x block_size tokens, by kind (MEMORY_KINDS):
    weights; grads (and DDP's flat buckets); optimizer, its state; activations autograd keeps for the backward
    (checkpointing: each block's input, and one block's activations at a time); copies of the weights in the compute
    dtype (autocast's, kept for the backward; FSDP: the gathered root, and one block with its gradients); temporary, the
    peak of what lives a moment at the loss (its buffers, forward and backward, and the last block's backward's); host,
    what offload keeps there; device, the device's peak: at the loss (gradients are None between steps but DDP's buckets
    and, with micro_steps > 1, those kept between micro-steps) or, checkpointing, while the backward recomputes a block
    (the last, beside every block's input, or the first, beside every other block's gradients), or past the blocks'
    backward (tied embeddings: the head's gradient of the shared weight, the embedding's, the sum); checkpoint, a
    checkpoint's bytes over all processes (the weights or a LoRA run's adapters alone, and the optimizer's state), for
    checkpoint.check_room. Activations and optimizer state (optimizer: a setting's name, or the run's settings) are
    traced on fake tensors (traced_forward, traced_optimizer), so edits of the model or optimizers need none here.
    Layout: dp data-parallel processes, each whole (DDP) or sharding every parameter's dim 0 (FSDP2), times tp
    tensor-parallel ones. quantized: 'nf4' or 'int8' frozen projections (int8: a byte a value, an fp32 scale and an int8
    zero point a row; activations as if unquantized); a model quantized already counts as it is. device: its type. Not
    counted: document masks, rotary tables, the allocator's cache, and kernels' own allocations but the fused loss's
    logits (workspace)."""
    c = model.config
    params = list(model.named_parameters())  # a tied weight once
    ddp = dp > 1 and not fsdp  # (tensor parallel runs under FSDP)
    state = traced_optimizer(model, optimizer, tp)
    weights, grads, optim = state_bytes(params, state, dp, tp, fsdp, quantized, ddp)
    in_checkpoint = [(n, p) for n, p in params if p.requires_grad or not c.lora_rank]  # a LoRA run's: its adapters
    checkpoint = sum(state_bytes(in_checkpoint, state, 1, 1, False, None, False)[::2])  # weights and optimizer state
    saved = traced_forward(model, batch_size, block_size, dtype, tp, fsdp, device, quantized)
    if fsdp:  # gathered in the compute dtype: the root (embedding, head) all step, a block and its gradients
        e = 4 if dtype == "float32" else 2  # a weight's bytes in the compute dtype
        root = sum(held_values(n, p, dp, tp) for n, p in params if "blocks." not in n)
        copies = (root + 2 * sum(held_values(n, p, dp, tp) for n, p in params if "blocks.0." in n)) * e
    else:  # autocast's copies of the weights, kept for the backward (recomputed under checkpointing)
        copies = saved.head_copies + (1 if checkpointing else c.n_layer) * saved.block_copies
    stored = c.n_layer * (saved.block_input if checkpointing else saved.block)
    made = 0 if offload else grads  # offloaded, the gradients go to the host as they are made
    kept = made if micro_steps > 1 else made // 2 if ddp else 0
    peak = max(saved.head + stored + saved.temporary + kept, made)  # at the loss, or as the backward ends
    if checkpointing:  # or while the backward recomputes a block: its activations and its backward's own, the inputs
        # of the blocks not done and the gradients of those done (each block's: block_grads), or all, kept from an
        # earlier micro-step; the most at the last block (all inputs) or at the first (every gradient but its own)
        block_grads = 0 if offload else state_bytes([(n, p) for n, p in params if n.startswith("blocks.0.")],
                                                    state, dp, tp, fsdp, quantized, ddp)[1]
        peak = max(peak, saved.block + saved.block_backward + max(stored + max(kept, made - c.n_layer * block_grads),
                                                                  saved.block_input + max(kept, made - block_grads)))
    # the tail (after the blocks' backward): every gradient, but those not made yet (kept ones are), and saved.tail;
    # autocast's copies are gone by then, FSDP's gathered root is not
    missing = [(n, p) for n, p in params if n in saved.missing and micro_steps == 1]
    tail = max(0, made - state_bytes(missing, state, dp, tp, fsdp, quantized, False)[1]) + saved.tail
    return dict(weights=weights, grads=grads, optimizer=optim, copies=copies, temporary=saved.temporary,
                host=weights + grads + optim if offload else 0,
                activations=saved.head + stored + (saved.block if checkpointing else 0),
                device=max(copies + peak, tail + (root * e if fsdp else 0)) + (0 if offload else weights + optim),
                checkpoint=checkpoint)


def held_values(name, p, dp=1, tp=1, shard=False):
    """How many of parameter p's values (p named name) one process holds: tensor parallel over tp splits the
    projections, FSDP (shard) every parameter's dim 0 over dp, like torch.chunk (rank 0's share, the largest)."""
    shape = list(p.shape)
    if tp > 1 and name.endswith(COLUMN_PARALLEL):
        shape[0] //= tp
    if tp > 1 and name.endswith(ROW_PARALLEL):
        shape[1] //= tp
    if shard:
        shape[0] = -(-shape[0] // dp)
    return math.prod(shape)


def state_bytes(params, state, dp, tp, fsdp, quantized, ddp):
    """(weights, grads, optimizer state) in bytes one process holds of params [(name, p)]; state: traced_optimizer's."""
    def held(name, p):  # the bytes of this process's part
        if quantized_already(p):  # quantized already (nf4, int8): its parts, in proportion
            return tensor_bytes(p) * held_values(name, p, dp, tp, fsdp) // p.numel()
        if quantized and planned_quantized(name, p):
            n = held_values(name, p, dp, tp, fsdp)
            return nf4_bytes(n) if quantized == "nf4" else n + 5 * (n // p.shape[1])
        return held_values(name, p, dp, tp, fsdp) * p.element_size()

    trained = [(n, p) for n, p in params if p.requires_grad]
    return (sum(held(n, p) for n, p in params),
            sum(held_values(n, p, dp, tp, fsdp) * p.element_size() for n, p in trained) * (2 if ddp else 1),
            sum(state[n].per_value * held_values(n, p, dp, tp, fsdp) + state[n].whole for n, p in trained))


class StateBytes(NamedTuple):
    """One parameter's optimizer state in bytes (traced_optimizer): per_value, per value of the parameter, for state
    shaped like it (Adam's moments), split as the parameter is; whole, the rest (Adam's step, a factored moment)."""
    per_value: int
    whole: int


def traced_optimizer(model, optimizer="adamw", tp=1):
    """{name: StateBytes} for each trained parameter of model: the state its optimizers (build_optimizers' for
    optimizer: a setting's name, others at defaults, or the run's settings) keep after a step of probe_model's fake
    copy; the last block's stands for every later block's; a parameter the copy lacks (a module replaced by hand) has
    none. A step may stop early on fake tensors (below): this holds for an optimizer that makes all its state before
    any arithmetic of its step, as torch's do in _init_group. Built for the meta device, they take no fused step
    (torch's fused SGD has no fake: it would run on real tensors the probe's size); the unfused keep the same state."""
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               FakeTensorMode, UnsupportedOperatorException)
    settings = {**defaults(), **(optimizer if isinstance(optimizer, dict) else {"optimizer": optimizer})}
    probe = probe_model(model, tp)
    with FakeTensorMode(allow_fallback_kernels=False):  # an op without a fake raises, never allocates
        made_fake(probe, model)
        for p in probe.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        optimizers = build_optimizers(probe, settings, "meta")
        for opt, group in [(opt, group) for opt in optimizers for group in opt.param_groups]:
            # a group at a time: a step that stops in one group would leave the later groups without state
            kept, opt.param_groups = opt.param_groups, [group]
            try:
                opt.step()
            except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException):
                pass  # it asked a fake tensor for a value (Adafactor's step.item()) or ran an op without a fake
            finally:
                opt.param_groups = kept
        traced = {name: state_of(p, optimizers) for name, p in probe.named_parameters()}
    last = len(probe.blocks) - 1
    return {name: traced.get(re.sub(r"^blocks\.(\d+)\.", lambda m: f"blocks.{min(int(m[1]), last)}.", name),
                             StateBytes(0, 0)) for name, p in model.named_parameters() if p.requires_grad}


def state_of(p, optimizers):
    # StateBytes of parameter p: every tensor the optimizers keep for it, of its shape or else whole
    kept = [t for opt in optimizers for t in opt.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
    return StateBytes(sum(t.element_size() for t in kept if t.shape == p.shape),
                      sum(tensor_bytes(t) for t in kept if t.shape != p.shape))


# --- What a forward keeps for the backward, traced on fake tensors: no memory, so a 7B model costs what a tiny one does


class Saved(NamedTuple):
    """Bytes a forward keeps for the backward (traced_forward): block and block_copies, one block's activations and its
    weights' autocast copies; head and head_copies, the same for all but n_layer blocks; block_input, what checkpointing
    keeps of a block; temporary, the peak beyond them from the last block's output until the backward is back at it;
    block_backward, the peak beyond the last block's activations and the gradients set in that block's backward;
    tail, the peak from the first block's input's gradient to the backward's end, less the gradients set by then;
    missing, the names of the trained parameters whose gradient was not set at that peak."""
    block: int
    block_copies: int
    head: int
    head_copies: int
    block_input: int
    temporary: int
    block_backward: int
    tail: int
    missing: list


def traced_forward(model, batch_size, block_size, dtype="float32", tp=1, fsdp=False, device="cuda", quantized=None):
    """Saved for a micro-batch of batch_size x block_size tokens through model under dtype's autocast, traced on
    probe_model's fake copy: in one forward, the storages autograd's saved tensors live in (each once, by the block that
    first saved it; the weights' own count as weights); in its backward to the last block's input, the peak alive, and
    past the first block's, the tail's (Trace). It runs on a CPU (fake CUDA tensors need a CUDA build of torch), where
    x.is_cuda and x.is_cpu answer for device (AskedAbout), so the model chooses as there: the fused kernels (their fakes
    keep what they keep), attention in bf16 (model.attend). Known error: the CPU's ops stand in where autograd's
    formulas do not decide what is kept (SDPA's CPU flash keeps what CUDA's does, but not dropout's RNG state); a model
    asking x.device is told the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    compute = getattr(torch, dtype)
    probe = probe_model(model, tp)
    with FakeTensorMode():
        made_fake(probe, model, compute if fsdp else None)
        # an int8 weight is dequantized at each use, and the backward keeps that copy: counted as it is saved
        # (nf4's own op keeps the nf4 weight, a weight)
        twins = dict(model.named_parameters())
        dequantized = {storage_key(p) for n, p in probe.named_parameters()
                       if int8_weight(n, twins.get(n, p), quantized)}
        trace = Trace({storage_key(t) for t in [*probe.parameters(), *probe.buffers()]} - dequantized,
                      len(probe.blocks), list(probe.named_parameters()))
        for i, block in enumerate(probe.blocks):
            block.register_forward_pre_hook(partial(trace.enter, i))
            block.register_forward_hook(partial(trace.leave, i))
        with trace:
            with torch.autocast("cpu", compute, enabled=dtype != "float32"), AskedAbout(device), \
                    torch.autograd.graph.saved_tensors_hooks(trace.pack, lambda t: t):
                idx = torch.zeros((batch_size, block_size), dtype=torch.long)
                loss = probe(idx, idx)[1]
            saved, end = trace.saved_bytes(), trace.alive
            loss.backward()
    return Saved(*saved, block_input=trace.block_input, temporary=max(0, trace.peak - end),
                 block_backward=trace.block_backward,
                 tail=trace.tail, missing=trace.missing)


def int8_weight(name, p, quantized=None):
    # whether parameter p (named name) is an int8 weight: torchao's already (its values, its largest part, in int8),
    # or a frozen projection planned as one
    if quantized_already(p):
        return max((getattr(p, part) for part in p.__tensor_flatten__()[0]), key=torch.numel).dtype == torch.int8
    return quantized == "int8" and planned_quantized(name, p)


def quantized_already(p):
    # a parameter torchao quantized (a tensor subclass made of tensors; a DTensor is a shard, not that)
    return hasattr(p, "__tensor_flatten__") and type(p) is not nn.Parameter and not is_dtensor(p)


def planned_quantized(name, p):
    # whether lora_base_dtype='nf4' or 'int8' quantizes parameter p (named name): a frozen projection's matrix
    return not p.requires_grad and name.endswith(COLUMN_PARALLEL + ROW_PARALLEL) and p.dim() == 2


def probe_model(model, tp=1):
    """model's class rebuilt from its config on the meta device (module.to() works there, for add_lora; made_fake
    follows) with one block, all blocks' work being alike (two under LoRA, whose first keeps no input), tp's share of
    the heads and the MLP's width, and model's adapters. Edits of the class follow; modules replaced by hand do not."""
    c = model.config
    own = next(k for k in type(model).__mro__ if not k.__module__.startswith("torch."))  # not FSDP's FSDPGPT
    with torch.device("meta"):
        probe = own(dataclasses.replace(c, n_layer=min(c.n_layer, 2 if c.lora_rank else 1), n_head=c.n_head // tp,
                                        n_kv_head=c.n_kv_head // tp, mlp_hidden=c.mlp_hidden // tp, lora_rank=0))
        if c.lora_rank:
            from lib.lora import add_lora
            add_lora(probe, c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_targets)
    return probe


def made_fake(probe, model, param_dtype=None):
    # Under FakeTensorMode: probe's parameters and buffers made fakes with the dtype (a quantized weight's: the one it
    # computes in) and requires_grad of their twins in model; param_dtype, FSDP's gathered dtype, for floating ones
    twins = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    made = {}  # a tied weight stays one tensor
    for path, module in probe.named_modules():
        for held in (module._parameters, module._buffers):
            for name, t in [(name, t) for name, t in held.items() if t is not None]:
                if id(t) not in made:
                    twin, weight = twins.get(f"{path}.{name}".lstrip("."), t), held is module._parameters
                    kind = param_dtype if weight and param_dtype and t.is_floating_point() else twin.dtype
                    fake = torch.empty(t.shape, dtype=kind)
                    made[id(t)] = nn.Parameter(fake, twin.requires_grad) if weight else fake
                held[name] = made[id(t)]


def storage_key(t):
    # the storage a tensor (or a view of it) lives in: its C++ object's address, a fake tensor's too
    return t.untyped_storage()._cdata


def workspace(func, args):
    # what an op allocates inside itself, which its fake does not show: the fused loss's chunk of logits
    if func.name() == "kernels::linear_cross_entropy":  # (kernels.py is imported already, where its op ran)
        from kernels import LCE_CHUNK_ELEMENTS
        x, weight = args[:2]
        return min(x.shape[0] * weight.shape[0], LCE_CHUNK_ELEMENTS) * x.element_size()
    return 0


class Trace(TorchDispatchMode):
    """The storages that the ops under it make on fake tensors, each once: the bytes alive now (alive) and at their peak
    while window is open, from the last block's output until the backward is back at its input; in the tail, from the
    first block's input's gradient to the end, the peak of those bytes less params' gradients set (tail), and which
    trained params had none then (missing); in the last block's backward, the peak beyond what was alive as it began,
    less its output's gradient, and beyond the gradients set (block_backward); which are casts of a weight (autocast's
    copies); and, through saved_tensors_hooks (pack), which autograd saves, by the block (its index, or None) whose
    forward first saved it. weights: the parameters' and buffers' storages, never counted; params: [(name,
    parameter)]."""

    def __init__(self, weights, blocks, params=()):
        super().__init__()
        self.weights, self.blocks, self.params = weights, blocks, params
        self.tail, self.missing, self.in_tail = 0, (), False
        self.made, self.casts = {}, set()  # storage: (bytes, a weakref to it); the weights' casts
        self.saved = {}  # storage: (bytes, block)
        self.alive = self.peak = self.block_input = 0
        self.region, self.window = None, False
        self.block_backward, self.in_block, self.before_block = 0, False, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in [t.untyped_storage() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]:
            key = storage._cdata  # (storage_key)
            if key not in self.made and key not in self.weights:  # its weakref calls free once no tensor lives in it
                self.made[key] = (storage.nbytes(), weakref.ref(storage, partial(self.free, key)))
                self.alive += storage.nbytes()
        if func is torch.ops.aten._to_copy.default and storage_key(args[0]) in self.weights:
            self.casts.add(storage_key(out))
        if self.window:
            self.peak = max(self.peak, self.alive + workspace(func, args))
        if self.in_block:
            self.block_backward = max(self.block_backward, self.alive - self.grad_bytes() - self.before_block)
        held = self.in_tail and self.alive - self.grad_bytes()
        if held > self.tail:
            self.tail, self.missing = held, [n for n, p in self.params if p.requires_grad and p.grad is None]
        return out

    def grad_bytes(self):
        return sum(tensor_bytes(p.grad) for _, p in self.params if p.grad is not None)

    def free(self, key, _):
        self.alive -= self.made.pop(key)[0]
        self.casts.discard(key)

    def pack(self, t):
        key = storage_key(t)
        if key not in self.weights and key not in self.saved:
            self.saved[key] = (t.untyped_storage().nbytes(), self.region)
        return t

    def enter(self, i, block, args):
        self.region, self.block_input = i, tensor_bytes(args[0])
        if args[0].requires_grad:
            args[0].register_hook(partial(self.back_at, i))

    def leave(self, i, block, args, out):
        self.region, self.window = None, i == self.blocks - 1
        if self.window and out.requires_grad:
            out.register_hook(self.into_last)

    def into_last(self, grad):
        # the backward at the last block's output: what is alive then, less its gradient and those set, is its base
        self.in_block, self.before_block = True, self.alive - tensor_bytes(grad) - self.grad_bytes()

    def back_at(self, i, grad):
        # the backward at block i's input: the window closes at the last block's, the tail opens at the first's
        self.window, self.in_tail = self.window and i < self.blocks - 1, self.in_tail or i == 0
        self.in_block = self.in_block and i < self.blocks - 1

    def saved_bytes(self):
        # (the last block's activations and copies, the rest's beside n such blocks): deeper models' blocks are like it
        totals = Counter()  # (a cast of a weight, saved by the last block): bytes
        for key, (nbytes, region) in self.saved.items():
            totals[key in self.casts, region == self.blocks - 1] += nbytes
        block, block_copies = totals[False, True], totals[True, True]
        return (block, block_copies, totals[False, False] - (self.blocks - 1) * block,
                totals[True, False] - (self.blocks - 1) * block_copies)


class AskedAbout(TorchFunctionMode):
    # x.is_cuda and x.is_cpu answered for a device of the given kind, whatever the tensor's (traced_forward)
    def __init__(self, device):
        super().__init__()
        self.kind = torch.device(device).type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        asked = getattr(func, "__self__", None)
        if asked is torch.Tensor.is_cuda or asked is torch.Tensor.is_cpu:
            return self.kind == asked.__name__[3:]
        return func(*args, **(kwargs or {}))


def memory_layout(dp=1, tp=1, fsdp=False, checkpointing=False, offload=False):
    # memory_estimate's layout in a few words, for memory_table: "FSDP x8 + TP x8 + checkpointing"
    parts = [f"{'FSDP' if fsdp else 'DDP'} x{dp}" if dp > 1 or fsdp else "", f"TP x{tp}" if tp > 1 else "",
             "checkpointing" if checkpointing else "", "offload" if offload else ""]
    return " + ".join(p for p in parts if p) or "1 process"


def memory_table(rows):
    """[(layout, memory_estimate's dict)] -> a Markdown table in MiB, a row each."""
    def mib(n):  # small models' figures keep two decimals
        return f"{n / 2**20:,.0f}" if n >= 10 * 2**20 or n == 0 else f"{n / 2**20:.2f}"
    lines = ["| MiB per process | " + " | ".join(MEMORY_KINDS) + " |", "| --- " * 9 + "|"]
    lines += [f"| {name} | " + " | ".join(mib(estimate[k]) for k in MEMORY_KINDS) + " |" for name, estimate in rows]
    return "\n".join(lines)


def measured_mb(device):
    """This process's peak so far in MiB: on CUDA the allocator's, elsewhere its resident memory's."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = proc_kib("VmHWM")  # ru_maxrss would start from the parent's when a big process launched us
    if peak is not None:
        return peak / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)


def proc_kib(field, path="/proc/self/status"):
    # a field of a Linux /proc file in KiB (status's VmRSS: resident now, VmHWM: its peak), or None without /proc
    try:
        with open(path) as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def device_name(device):
    """What a micro-batch is chosen for: a GPU's name and memory, a CPU's with the machine's, or the kind."""
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return f"{properties.name}, {properties.total_memory / 2**30:.1f} GiB"
    if device.type == "cpu" and hasattr(os, "sysconf"):
        return f"cpu, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.1f} GiB"
    return device.type
