"""
LoRA: low-rank adapters beside a frozen model's projections, folded back into the weights for export, the frozen
base held in 4 bits (QLoRA, through torchao), and the adapters alone in peft's layout.

    from lib.lora import add_lora, merge_lora
    add_lora(model, rank=8)       # every weight frozen; q, k, v, o, gate, up, down adapted
    merge_lora(model)             # W + (alpha/rank)·B·A: a plain model with the same outputs
"""

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from lib.files import UserError, open_own
from lib.hf import HF_PROJECTIONS
from lib.settings import LORA_BASE_DTYPES
from model import PROJECTIONS


class LoRA(nn.Module):
    """A frozen projection's adapter (linear.lora): its output gains (alpha/rank)·B A x, A (rank, in), B (out, rank).
    B starts at zero, so an adapted model starts exactly as its base."""

    def __init__(self, in_features, out_features, rank, alpha, dropout):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's own init, as peft does
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        # x in the adapter's dtype (fp32) without autocast (a bf16 base on a CPU would multiply bf16 by fp32), not
        # copied under it; the scale on the rank-wide middle: together 8% faster, 9% less memory (BENCHMARKS.md)
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.B.dtype)
        return F.linear(F.linear(self.dropout(x), self.A) * self.scale, self.B)

    def delta(self):
        # the change to the frozen weight, (out, in) in fp32, for merging
        return self.scale * self.B.float() @ self.A.float()


def check_lora(asked, rank, base_dtype, tp, fsdp):
    """UserError for LoRA settings that cannot run: asked, the lora_rank set; rank, the run's (the checkpoint's on
    a resume, 0 without a pretrained folder); base_dtype, lora_base_dtype."""
    if asked and not rank:
        raise UserError("LoRA adapts a pretrained model: set init_from to a Hugging Face folder (export a run of "
                         "yours to one with export.py)")
    if base_dtype not in LORA_BASE_DTYPES:
        raise UserError(f"lora_base_dtype={base_dtype!r} is not one of {', '.join(LORA_BASE_DTYPES)}")
    if rank and tp > 1:
        raise UserError("LoRA does not run under tensor parallel: use fsdp=True to spread a larger model "
                         "(tp_size=1)")
    if fsdp and rank and base_dtype in ("nf4", "int8"):
        raise UserError(f"lora_base_dtype={base_dtype!r} cannot be sharded by fsdp=True (FSDP does not split "
                         f"quantized tensors): use lora_base_dtype='bfloat16' with fsdp, or {base_dtype} without it")


def add_lora(model, rank, alpha=16.0, dropout=0.0, targets="q,k,v,o,gate,up,down"):
    """Freeze every weight and give the projections named in targets fp32 low-rank adapters, which alone train."""
    chosen = set(targets.split(","))
    unknown = sorted(chosen - set(PROJECTIONS))
    if unknown:
        raise UserError(f"lora_targets={targets!r}: {unknown[0]!r} is none of {','.join(PROJECTIONS)} (name some of "
                        f"them, apart by commas alone)")
    if rank < 1:
        raise UserError(f"lora_rank={rank} must be at least 1")
    widest = max(max(linear.weight.shape) for _, name, linear in model.projections() if name in chosen)
    if rank > widest:  # (before any adapter is made: a rank of 10**9 asked for 128 GB)
        raise UserError(f"lora_rank={rank} is past the widest of the projections it adapts ({widest}): its adapters "
                         f"would outweigh the weights; take at most {widest} (8 to 64 is usual)")
    model.config.lora_rank, model.config.lora_alpha, model.config.lora_dropout = rank, alpha, dropout
    model.config.lora_targets = targets
    model.requires_grad_(False)
    for _, name, linear in model.projections():
        if name in chosen:
            linear.lora = LoRA(linear.in_features, linear.out_features, rank, alpha, dropout).to(linear.weight.device)
    return model


def merge_lora(model, dtype=None, device=None):
    """Fold every adapter into its weight, W + (alpha/rank)·B·A in fp32 cast to dtype (None: W's): a plain model.
    An export's dtype, not a bf16 base's: rounded to bf16, a float32 export would lose the adapters' small changes.
    device: where each merged weight goes (None: its own; export's CPU, as a GPU holds a 4-bit base, not merged)."""
    if not model.config.lora_rank:  # (nothing to fold: a model.py edited past its projections is told so by export)
        return model
    for _, _, linear in model.projections():
        lora, weight = getattr(linear, "lora", None), linear.weight.detach()
        # quantize_base holds all seven projections quantized, adapted or not (lora_targets): every one goes back
        if lora is None and type(weight) is torch.Tensor:
            continue
        if hasattr(weight, "get_original_weight"):  # 4-bit: back to the dtype it was quantized from
            weight = weight.get_original_weight()
        elif type(weight) is not torch.Tensor:  # 8-bit
            weight = weight.dequantize()
        merged = weight.float() + (lora.delta().to(weight.device) if lora is not None else 0)
        linear.weight = nn.Parameter(merged.to(dtype or weight.dtype).to(device), requires_grad=False)
        if lora is not None:
            del linear.lora
    model.config.lora_rank = 0
    return model


def quantize_base(model, kind="nf4", device=None):
    """Hold the frozen projections' weights in 4-bit NF4 (QLoRA) or int8 (weight-only, a scale per output row)
    through torchao, each keeping the dtype it computes in; embeddings, norms and adapters stay as they are. device:
    where each goes first, one at a time, to be quantized there (a GPU never holds the whole unquantized base)."""
    for _, _, linear in model.projections():
        quantize_weight(linear, linear.weight.detach(), kind, device)
    return model


def quantize_weight(linear, weight, kind="nf4", device=None):
    # linear's weight becomes weight (of its shape and dtype) quantized on device (quantize_base; hf.load_pretrained
    # as it reads a folder's weights, so that no process holds a 70B base whole in bf16)
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
    except ImportError:
        raise UserError(f"{kind} base weights need torchao: pip install torchao") from None
    if kind == "int8":
        linear.weight = nn.Parameter(weight.to(device), requires_grad=False)
        quantize_(linear, Int8WeightOnlyConfig(), device=device)
        return
    if weight.numel() % 64:
        raise UserError(f"a {tuple(weight.shape)} weight cannot be held in nf4 (blocks of 64 values): hold this "
                        f"model's base with lora_base_dtype='int8', or in its own dtype ('auto')")
    # QLoRA's blocks: 64 values per scale, 256 scales per second-level scale (fewer in tiny models)
    quantized = to_nf4(weight.to(device), 64, math.gcd(256, weight.numel() // 64))
    linear.weight = nn.Parameter(quantized, requires_grad=False)


def write_adapter(model, base, folder, dtype=torch.float32):
    """The adapters in peft's layout (transformers' names), in dtype, in folder; base: the Hugging Face folder they
    go on."""
    from safetensors.torch import save_file
    c = model.config
    if not c.lora_rank:
        raise UserError("--adapter exports a LoRA run's adapters, and this run trained every weight (leave it out)")
    tensors = {}
    for i, name, linear in model.projections():
        if getattr(linear, "lora", None) is not None:
            module = f"base_model.model.model.layers.{i}.{HF_PROJECTIONS[name]}"
            tensors[f"{module}.lora_A.weight"] = linear.lora.A.detach().to(dtype).contiguous()
            tensors[f"{module}.lora_B.weight"] = linear.lora.B.detach().to(dtype).contiguous()
    targets = {HF_PROJECTIONS[t].split(".")[-1] for t in c.lora_targets.split(",")}
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
              "r": c.lora_rank, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "inference_mode": True, "modules_to_save": None, "init_lora_weights": True}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open_own(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
