"""
The whole transformer in one file: a Llama-style GPT (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, no biases unless a Qwen2 brings them); Hugging Face folders in and out
(GPT.from_pretrained, save_pretrained); LoRA adapters on a frozen base (add_lora, merge_lora).

    import torch
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    logits, _ = model(torch.randint(0, 256, (1, 16)))               # (1, 16, 256)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20)    # (1, 21)
"""

import inspect
import json
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

try:  # optional: only used on CUDA for bf16/fp16 tensors
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None
flex_attention = None  # document masking's fast path on CUDA, imported and compiled when first needed (~3 s)


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the model takes (trained from scratch: the one it is trained on)
    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64 for fast matmuls
    n_layer: int = 12
    n_head: int = 12  # query heads
    n_kv_head: int = 0  # key/value heads shared by groups of query heads; 0 means n_head (no grouping)
    n_embd: int = 768
    dropout: float = 0.0
    tie_embeddings: bool = True  # LM head shares the token embedding's weight
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    use_kernels: bool | None = None  # Triton fused ops; None: on for CUDA with Triton, off elsewhere
    # What released models need beyond that (from_pretrained sets them; the defaults are ours):
    head_size: int = 0  # width of one head; 0 means n_embd // n_head (Qwen3's is its own)
    mlp_hidden: int = 0  # SwiGLU width; 0 means 8/3 n_embd rounded up to a multiple of 64
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm on every head's q and k before rotary (Qwen3)
    rope_scaling: dict | None = None  # Llama 3.1's long-context frequencies (see rotary_tables)
    family: str = "llama"  # the Hugging Face model_type the weights came from and are saved as
    # LoRA: low-rank adapters on a frozen model (see LoRA and GPT.add_lora); rank 0 is off
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = "q,k,v,o,gate,up,down"

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if not self.head_size and self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        self.head_size = self.head_size or self.n_embd // self.n_head
        self.mlp_hidden = self.mlp_hidden or 64 * math.ceil(8 * self.n_embd / 3 / 64)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if self.head_size % 2:
            raise ValueError(f"head size {self.head_size} must be even for rotary embeddings")


def pick_ops(fused):
    # the memory-bound ops the model uses: kernels.py's fused ones, or their plain references
    names = ("rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy")
    return SimpleNamespace(**{n: getattr(kernels, n if fused else n + "_ref") for n in names})


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, ops):
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self.ops.rms_norm(x, self.weight, self.eps)


def rotary_tables(head_size, length, theta, scaling=None):
    # cos/sin for every position and frequency: (length, head_size/2), fp32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    if scaling:  # Llama 3.1: slow frequencies divided by factor, fast ones kept, a smooth ramp between
        wavelen = 2 * math.pi / inv_freq
        context = scaling["original_max_position_embeddings"]
        ramp = (context / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
        ramp = ramp.clamp(0, 1)  # 0 for wavelengths past context/low_freq_factor, 1 below context/high_freq_factor
        inv_freq = (1 - ramp) * inv_freq / scaling["factor"] + ramp * inv_freq
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class LoRA(nn.Module):
    """A low-rank adapter for a frozen projection: its output gains (alpha/rank)·B A x, with A (rank, in)
    and B (out, rank). B starts at zero, so an adapted model starts exactly as its base."""

    def __init__(self, in_features, out_features, rank, alpha, dropout):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))  # nn.Linear's own init, as peft does
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        # in the adapter's own dtype (fp32) whatever the frozen base's: a bf16 base on a CPU without
        # autocast would otherwise multiply bf16 by fp32; under autocast the matmuls are bf16 anyway
        x = self.dropout(x).to(self.B.dtype)
        return (x @ self.A.t()) @ self.B.t() * self.scale

    def delta(self):
        # the change to the frozen weight, (out, in) in fp32, for merging
        return self.scale * self.B.float() @ self.A.float()


def adapted(linear, x):
    # a projection's output, plus its adapter's where LoRA gave it one
    y = linear(x)
    return y if getattr(linear, "lora", None) is None else y + linear.lora(x).to(y.dtype)


def attend(q, k, v, **kwargs):
    # torch's scaled_dot_product_attention on (B, T, H, D) tensors. Under a CPU's bf16 autocast it runs in
    # fp32: torch's CPU attention is ~5x slower backward in bf16 than in fp32 (BENCHMARKS.md)
    if q.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return attend(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          **kwargs).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.n_kv_head, config.head_size
        q_size, kv_size = self.n_head * self.head_size, self.n_kv_head * self.head_size
        # separate projections (not one fused qkv): tensor parallel splits each by heads
        self.q = nn.Linear(config.n_embd, q_size, bias=config.qkv_bias)
        self.k = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.v = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.proj = nn.Linear(q_size, config.n_embd, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.norm_eps, ops)
            self.k_norm = RMSNorm(self.head_size, config.norm_eps, ops)
        self.qk_norm = config.qk_norm
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x, cos, sin, cache=None, mask=None):
        B, T, C = x.shape
        # head counts from the shapes: under tensor parallel a process holds only its share of the heads
        q = adapted(self.q, x).view(B, T, -1, self.head_size)  # (B, T, H, D)
        k = adapted(self.k, x).view(B, T, -1, self.head_size)  # (B, T, Hkv, D)
        v = adapted(self.v, x).view(B, T, -1, self.head_size)
        n_head, n_kv_head = q.size(2), k.size(2)
        if self.qk_norm:  # each with its own weight
            q, k = self.q_norm(q), self.k_norm(k)
        # rotated apart: joining them to rotate in one call costs a copy forward and another backward
        q, k = self.ops.apply_rotary(q, cos, sin), self.ops.apply_rotary(k, cos, sin)
        if cache is not None:  # generation: prepend the keys and values of earlier positions
            if cache:
                k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
            cache[:] = [k, v]
        # a single query attends to the whole cache; otherwise queries and keys start together
        causal = T > 1
        dropout = self.dropout if self.training else 0.0
        gqa = n_kv_head != n_head
        if mask is not None and not isinstance(mask, torch.Tensor):  # documents on CUDA: FlexAttention
            y = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                               enable_gqa=gqa).transpose(1, 2)
        elif mask is not None:  # documents elsewhere: a (B, 1, T, T) boolean mask, True where a query looks
            y = attend(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
        elif flash_attn_func is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            y = flash_attn_func(q, k, v, dropout_p=dropout, causal=causal)  # (B, T, H, D), GQA built in
        else:
            y = attend(q, k, v, dropout_p=dropout, is_causal=causal, enable_gqa=gqa)
        return self.resid_dropout(adapted(self.proj, y.reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        # by default 2/3 of the classic 4x width, which keeps parameters equal to a GELU MLP
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x):
        return self.dropout(adapted(self.down, self.ops.swiglu(adapted(self.gate, x), adapted(self.up, x))))


class Block(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps, ops)
        self.attn = Attention(config, ops)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, x, cos, sin, cache=None, mask=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache, mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        if config.use_kernels is None:
            config.use_kernels = torch.cuda.is_available() and kernels.HAS_TRITON
        self.ops = pick_ops(config.use_kernels)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, self.ops) for _ in range(config.n_layer)])
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps, self.ops)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        cos, sin = rotary_tables(config.head_size, config.block_size, config.rope_theta, config.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)  # derived from the config: not saved
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init_weights)
        # scaled init of the projections into the residual stream (GPT-2 paper)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        if config.lora_rank:
            self.add_lora(config.lora_rank, config.lora_alpha, config.lora_dropout, config.lora_targets)

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if non_embedding:
            n -= self.wte.weight.numel()
        return n

    def forward(self, idx, targets=None, cache=None, doc_ids=None):
        # idx: (B, T) token ids. With targets (B, T) it returns (None, mean loss) and never builds
        # the full logits; without, (logits (B, T, V), None). cache: list of n_layer lists, see generate.
        # doc_ids: (B, T) document numbers of packed sequences; a token then attends only to earlier
        # tokens of its own document (for training and evaluation, not with a cache).
        x = self.hidden(idx, cache, doc_ids)
        if targets is None:
            return self.lm_head(x), None
        B, T = idx.shape
        loss = self.ops.linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.reshape(B * T))
        return None, loss

    def hidden(self, idx, cache=None, doc_ids=None):
        # the final normed hidden states (B, T, C), on which the LM head computes the logits
        B, T = idx.shape
        start = cache[0][0].shape[1] if cache and cache[0] else 0  # positions already in the cache
        if start and T > 1:  # the causal mask below assumes queries and keys start together
            raise ValueError("with a filled cache, feed one token at a time")
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        if doc_ids is not None and cache is not None:
            raise ValueError("doc_ids masks training and evaluation sequences; generation takes no doc_ids")
        mask = None if doc_ids is None else document_mask(doc_ids, flex=idx.is_cuda and not (
            self.training and self.config.dropout > 0))  # FlexAttention has no dropout
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache[i] if cache is not None else None, mask)
        return self.norm_f(x)

    @torch.no_grad()
    def loss_and_accuracy(self, idx, targets, doc_ids=None, chunk_elements=2**24):
        """(mean loss, next-token accuracy) over the targets that are not -1, as 0-d tensors. The logits
        are built a chunk of rows at a time (chunk_elements of them, 64 MB in fp32), never all at once."""
        x = self.hidden(idx, doc_ids=doc_ids)
        x, targets = x.view(-1, x.size(-1)), targets.reshape(-1)
        rows = max(1, chunk_elements // self.config.vocab_size)
        loss_sum = torch.zeros((), device=x.device)
        correct = torch.zeros((), device=x.device, dtype=torch.long)
        for i in range(0, len(targets), rows):
            logits, t = self.lm_head(x[i:i + rows]).float(), targets[i:i + rows]  # (rows, V), (rows,)
            loss_sum += F.cross_entropy(logits, t, ignore_index=-1, reduction="sum")
            correct += (logits.argmax(dim=-1) == t).sum()  # an ignored target (-1) is never the argmax
        n = (targets != -1).sum().clamp(min=1)
        return loss_sum / n, correct / n

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None):
        # idx: (B, T). Appends max_new_tokens sampled tokens, reusing keys and values of earlier
        # positions (a KV cache). Past block_size, the window slides: the cache is rebuilt from the
        # last block_size tokens, so every step sees exactly what a full forward pass would.
        cache = None
        for _ in range(max_new_tokens):
            if cache is None or idx.shape[1] > self.config.block_size:
                cache = [[] for _ in self.blocks]
                logits, _ = self(idx[:, -self.config.block_size:], cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :].float()  # (B, V)
            if temperature == 0:  # greedy
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx

    def flops_per_token(self, seq_len=None):
        # training FLOPs per token: 6N for the weights' matmuls plus attention's 12·L·H·Q·T (PaLM, B),
        # T being the length trained on (by default the longest the model takes); a frozen weight (LoRA's
        # base) costs 4, having no gradient of its own
        c = self.config
        n = self.num_params(non_embedding=not c.tie_embeddings)  # the embedding lookup is no matmul
        frozen = sum(p.numel() for name, p in self.named_parameters()
                     if not p.requires_grad and (c.tie_embeddings or name != "wte.weight"))
        return 6 * n - 2 * frozen + 12 * c.n_layer * c.n_head * c.head_size * (seq_len or c.block_size)

    def configure_optimizers(self, kind, learning_rate, weight_decay, betas, device_type, momentum=0.9,
                             muon_lr=0.02, muon_momentum=0.95):
        """A list of optimizers over the trainable parameters, the first one covering what the others do not.
        kind: 'adamw', 'adam', 'sgd' (momentum), or 'muon': torch.optim.Muon at muon_lr for the blocks' 2-D
        matrices, AdamW at learning_rate beside it for the embedding, the head, the norms and any bias.
        Weight decay goes to matrices only: norms' weights (and any other 1-D parameter) are left alone."""
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        hidden = [p for n, p in named if kind == "muon" and n.startswith("blocks.") and p.dim() == 2]
        in_muon = {id(p) for p in hidden}
        rest = [p for n, p in named if id(p) not in in_muon]
        groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
        # one fused kernel for all parameters where there is one (CUDA, and CPU since torch 2.4)
        fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type in ("cuda", "cpu")
        if kind in ("adamw", "muon"):
            optimizers = [torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)]
        elif kind == "adam":  # weight decay as torch's Adam does it: an L2 term added to the gradient
            optimizers = [torch.optim.Adam(groups, lr=learning_rate, betas=betas, fused=fused or None)]
        elif kind == "sgd":
            optimizers = [torch.optim.SGD(groups, lr=learning_rate, momentum=momentum, fused=fused or None)]
        else:
            raise ValueError(f"optimizer={kind!r} is not one of 'adamw', 'muon', 'adam', 'sgd'")
        if hidden:
            optimizers.append(torch.optim.Muon(hidden, lr=muon_lr, weight_decay=weight_decay,
                                               momentum=muon_momentum))
        return optimizers

    # -------------------------------------------------------------------------
    # LoRA: a frozen base, trainable low-rank adapters, merged back for deployment

    def lora_projections(self):
        # (block index, LoRA's name for it, projection) for every projection LoRA can adapt
        for i, block in enumerate(self.blocks):
            a, m = block.attn, block.mlp
            yield from [(i, "q", a.q), (i, "k", a.k), (i, "v", a.v), (i, "o", a.proj),
                        (i, "gate", m.gate), (i, "up", m.up), (i, "down", m.down)]

    def add_lora(self, rank, alpha=16.0, dropout=0.0, targets="q,k,v,o,gate,up,down"):
        """Freeze every weight and give the projections named in targets (comma-separated, of q, k, v,
        o, gate, up, down) fp32 low-rank adapters: afterwards only the adapters get gradients."""
        chosen = set(targets.split(","))
        if chosen - set(LORA_TARGETS) or rank < 1:
            raise ValueError(f"lora_targets={targets!r} and lora_rank={rank} must name some of "
                             f"{','.join(LORA_TARGETS)} and be at least 1")
        self.config.lora_rank, self.config.lora_alpha, self.config.lora_dropout = rank, alpha, dropout
        self.config.lora_targets = targets
        self.requires_grad_(False)
        for _, name, linear in self.lora_projections():
            if name in chosen:
                lora = LoRA(linear.in_features, linear.out_features, rank, alpha, dropout)
                linear.lora = lora.to(linear.weight.device)
        return self

    def merge_lora(self):
        """Fold every adapter into its weight, W + (alpha/rank)·B·A computed in fp32 and cast back to
        W's dtype, and drop the adapters: a plain model again, with the same outputs."""
        for _, _, linear in self.lora_projections():
            if getattr(linear, "lora", None) is not None:
                weight = linear.weight.detach()
                if hasattr(weight, "get_original_weight"):  # 4-bit: back to the dtype it was quantized from
                    weight = weight.get_original_weight()
                merged = weight.float() + linear.lora.delta().to(weight.device)
                linear.weight = nn.Parameter(merged.to(weight.dtype), requires_grad=False)
                del linear.lora
        self.config.lora_rank = 0
        return self

    def quantize_base(self):
        """Hold the frozen projections' weights in 4-bit NF4 (QLoRA), through torchao; each keeps the
        dtype it had for computing. Embeddings, norms and the adapters stay as they are."""
        try:
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4
        except ImportError:
            raise ValueError("4-bit base weights need torchao: pip install torchao") from None
        for _, _, linear in self.lora_projections():
            n = linear.weight.numel()
            if n % 64:
                raise ValueError(f"a {tuple(linear.weight.shape)} weight cannot be held in nf4 (blocks of 64 values)")
            # QLoRA's blocks: 64 values per scale, 256 scales per second-level scale (fewer in tiny models)
            quantized = to_nf4(linear.weight.detach(), 64, math.gcd(256, n // 64))
            linear.weight = nn.Parameter(quantized, requires_grad=False)
        return self


    # -------------------------------------------------------------------------
    # Hugging Face folders in and out: transformers' names here and nowhere else

    @classmethod
    def from_pretrained(cls, path, dtype=None, block_size=None, **overrides):
        """A Llama, Mistral, Qwen2 or Qwen3 folder (config.json + safetensors) -> GPT. dtype: None keeps
        the weights'; block_size: the longest sequence it will be given, checked against the model's
        limit (which stays its config.block_size); overrides: GPTConfig fields that leave the weights
        alone (dropout, use_kernels). Tensors are copied one at a time into a model allocated once,
        so loading takes about one copy of the weights. What GPT lacks is a one-line ValueError."""
        path = Path(path)
        if set(overrides) - {"dropout", "use_kernels"}:
            raise ValueError(f"from_pretrained takes dropout and use_kernels, not {sorted(overrides)} (LoRA: add_lora)")
        hf = read_json(path / "config.json")
        try:
            config = replace(config_from_hf(hf, block_size), **overrides)
        except KeyError as e:
            raise ValueError(f"{path / 'config.json'} lacks {e}, which a {hf.get('model_type')} model needs") from None
        files = safetensors_files(path)
        with open_safetensors(files[0]) as f:  # the dtype of the first tensor is the folder's
            stored = f.get_slice(next(iter(f.keys()))).get_dtype()
        dtype = dtype or SAFETENSORS_DTYPES.get(stored, torch.float32)
        with torch.device("meta"):  # no memory yet, and no time spent on a random init
            model = cls(config)
        model = model.to(dtype).to_empty(device="cpu").materialize()
        params = dict(model.named_parameters())
        layout = hf_layout(config)
        missing = set(layout)
        for file in files:
            with open_safetensors(file) as f, torch.no_grad():
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and config.tie_embeddings):
                        continue  # derived from the config, or the tied embedding stored twice
                    if name not in layout:
                        raise ValueError(f"{file} holds {name}, which this model.py does not implement")
                    target = params[layout[name]]
                    tensor = f.get_tensor(name)
                    if tensor.shape != target.shape:
                        raise ValueError(f"{name} in {file} has shape {tuple(tensor.shape)}, but config.json "
                                         f"implies {tuple(target.shape)}")
                    target.copy_(tensor)
                    missing.discard(name)
        if missing:
            raise ValueError(f"{path} lacks {len(missing)} tensor(s) the config needs, e.g. {sorted(missing)[0]}")
        return model

    def materialize(self):
        # after a build on the meta device: the rotary tables are derived, not loaded, so they are
        # made now; and the tied head is one tensor with the embedding again (filling made two)
        c = self.config
        self.cos, self.sin = rotary_tables(c.head_size, c.block_size, c.rope_theta, c.rope_scaling)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        return self

    @classmethod
    def from_checkpoint(cls, checkpoint, base_dtype=None, **overrides):
        """A train.py checkpoint (as load_checkpoint returns it) -> GPT with its weights; overrides as in
        from_pretrained. A LoRA run's checkpoint holds only the adapters: they go onto its base folder
        again, read in base_dtype, which must be the very model the run began from."""
        args = {**checkpoint["model_args"], **overrides}
        if any(".qkv." in name or ".gate_up." in name for name in checkpoint["model"]):
            raise ValueError("this checkpoint is from an older model.py (fused attn.qkv and mlp.gate_up, before "
                             "2026-11-22): sample, export or resume it with that version")
        if not args.get("lora_rank"):
            with torch.device("meta"):  # the checkpoint's tensors become the weights: no second copy
                model = cls(GPTConfig(**args))
            model.load_state_dict(checkpoint["model"], assign=True)
            return model.materialize()
        base = checkpoint["pretrained"]
        if not os.path.isdir(base):
            raise ValueError(f"the base model this LoRA run began from is not at {base}: put it back there")
        if fingerprint(base) != checkpoint["base_fingerprint"]:
            raise ValueError(f"the base model at {base} is not the one this LoRA run began from (its weights "
                             f"differ): put that model back there")
        model = cls.from_pretrained(base, base_dtype, dropout=args["dropout"], use_kernels=args["use_kernels"])
        model.add_lora(args["lora_rank"], args["lora_alpha"], args["lora_dropout"], args["lora_targets"])
        missing, unexpected = model.load_state_dict(checkpoint["model"], strict=False)
        if unexpected or any(p.requires_grad for name, p in model.named_parameters() if name in missing):
            raise ValueError("the checkpoint does not hold this model's adapters")
        return model

    def save_pretrained(self, path, max_shard_bytes=5 * 2**30, eos_token_id=None):
        """Write config.json and model.safetensors (or shards with an index past max_shard_bytes, as the
        Hub does) in the model's dtype, for transformers, vLLM and llama.cpp's converter."""
        from safetensors.torch import save_file
        if self.config.lora_rank or any(hasattr(p, "get_original_weight") for p in self.parameters()):
            raise ValueError("save_pretrained writes plain weights: merge_lora() first, and load a 4-bit base "
                             "again unquantized (export.py does both)")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        with open(path / "config.json", "w") as f:
            json.dump(hf_config(self.config, self.wte.weight.dtype, eos_token_id), f, indent=2)
        params = dict(self.named_parameters())
        shards, size = [[]], 0
        for hf, ours in hf_layout(self.config).items():
            tensor = params[ours]
            if shards[-1] and size + tensor.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((hf, tensor))
            size += tensor.nbytes
        names = ["model.safetensors"] if len(shards) == 1 else \
            [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        for name, shard in zip(names, shards):  # one shard in memory at a time
            save_file({hf: t.detach().to("cpu", copy=True).contiguous() for hf, t in shard}, path / name,
                      metadata={"format": "pt"})
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(p.nbytes for p in self.parameters())},
                     "weight_map": {hf: name for name, shard in zip(names, shards) for hf, _ in shard}}
            with open(path / "model.safetensors.index.json", "w") as f:
                json.dump(index, f, indent=2)


def document_mask(doc_ids, flex=False):
    """doc_ids (B, T) -> the attention mask that lets a token see only itself and earlier tokens of its
    own document: FlexAttention's block mask (flex, on CUDA), else a (B, 1, T, T) boolean mask for SDPA."""
    global flex_attention
    B, T = doc_ids.shape
    if flex:
        from torch.nn.attention import flex_attention as flex
        if flex_attention is None:  # compiled, it is a fused kernel; eager, it would build the full scores
            flex_attention = torch.compile(flex.flex_attention, dynamic=False)

        def causal_in_document(b, h, q, k):
            return (k <= q) & (doc_ids[b, q] == doc_ids[b, k])
        return flex.create_block_mask(causal_in_document, B, None, T, T, device=doc_ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]  # (B, 1, T, T)


def filter_logits(logits, top_k=None, top_p=None):
    # logits: (B, V). Keep the top_k largest and the smallest set whose probability reaches top_p.
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_logits.softmax(dim=-1) > top_p  # mass before this token already reaches top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


def find_checkpoint(path):
    """The newest checkpoint of a name, as train.py writes them: 'out/ckpt.pt' (or 'out/ckpt') -> out/ckpt.pt
    (a file), out/ckpt/ (a sharded folder: FSDP and tensor parallel write torch.distributed.checkpoint's) or
    out/ckpt.old/ (the previous folder, where a save was killed between its two renames); of those that
    exist, the one at the latest step. None if there is none. A folder counts only with its state.pt."""
    if os.path.isfile(path) and not path.endswith(".pt"):
        return path  # a file named otherwise: the caller's own
    stem = path.removesuffix(".pt").rstrip("/")
    found = [p for p in (stem + ".pt", stem, stem + ".old")
             if os.path.isfile(p if p.endswith(".pt") else os.path.join(p, "state.pt"))]
    if len(found) > 1:  # a kill between two steps of a save, or a run resumed in the other layout
        def written(p):
            state = p if p.endswith(".pt") else os.path.join(p, "state.pt")
            return load_checkpoint(state, mmap=True)["iter_num"], os.path.getmtime(state)
        found.sort(key=written)
    return found[-1] if found else None


def read_sharded(folder, device="cpu"):
    """The model's weights of a sharded checkpoint, whole, in one process (no process group needed):
    {name: tensor}, as a file checkpoint's "model" holds them."""
    import warnings

    import torch.distributed.checkpoint as dcp
    try:
        stored = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        weights = {name.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype, device=device)
                   for name, m in stored.items() if name.startswith("model.")}
        with warnings.catch_warnings():  # that it reads in one process is what we ask for
            warnings.simplefilter("ignore")
            dcp.load({"model": weights}, checkpoint_id=folder, no_dist=True)
    except (dcp.api.CheckpointException, RuntimeError, OSError, AttributeError) as e:
        raise ValueError(f"{folder} is not a readable sharded checkpoint ({str(e).splitlines()[0]}); "
                         f"use another one, e.g. ckpt_best or a ckpt_NNNNNNN") from None
    return weights


def load_checkpoint(path, device="cpu", mmap=False, weights=True):
    # weights_only: a checkpoint is tensors and plain values; anything else is refused, and no code
    # in it runs. mmap: tensors are read from the file as they are used (a reader that needs only
    # the weights never reads the optimizer's moments). A damaged or foreign file is a ValueError.
    # A sharded folder: its state.pt, and (weights) the model's weights read whole from its shards.
    import pickle
    import warnings
    if os.path.isdir(path):
        checkpoint = load_checkpoint(os.path.join(path, "state.pt"), device, mmap)
        if weights:
            checkpoint["model"] = read_sharded(path, device)
        return checkpoint
    try:
        with warnings.catch_warnings():  # torch warns about what it refused; our error says it in one line
            warnings.simplefilter("ignore")
            try:
                return torch.load(path, map_location=device, weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                # a file not in torch.save's zip format cannot be mapped: read it whole instead (the
                # weights_only refusal of anything foreign happens there)
                return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds objects other than tensors and plain values; refusing to load it "
                         f"(only load checkpoints you trust, with code you have read)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a readable checkpoint ({str(e).splitlines()[0]}); "
                         f"use another one, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt") from None


def pick_device(device="auto", dtype="auto"):
    """Resolve the 'auto' settings: cuda, then mps, then cpu; bf16 where the GPU has it, else float32.
    Returns (device, dtype name); a CUDA device without a GPU or an unknown dtype is a one-line ValueError."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device} but no CUDA GPU is visible (use --device=cpu)")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r} is not one of 'float32', 'bfloat16', 'float16'")
    return device, dtype


def peak_flops(device, dtype):
    # dense matmul peak of one device in FLOP/s, for MFU; None where unknown
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        half = dtype in (torch.bfloat16, torch.float16)
        # (bf16/fp16 tensor cores, tf32) from the vendors' data sheets, dense
        table = {"H100 PCIe": (756e12, 378e12), "H100": (989e12, 494e12), "H200": (989e12, 494e12),
                 "B200": (2250e12, 1100e12), "A100": (312e12, 156e12), "L40S": (362e12, 183e12),
                 "A10G": (70e12, 35e12), "4090": (165e12, 83e12), "3090": (71e12, 36e12)}
        for key, (bf16, tf32) in table.items():
            if key in name:
                return bf16 if half else tf32
        return None
    if device.type == "cpu":
        # threads x clock x fp32 FLOPs per cycle of two FMA pipes: 64 with AVX-512, 32 with AVX2.
        # A nominal figure: boost clocks and double-pumped AVX-512 make the real one differ.
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
            mhz = float(info.split("cpu MHz")[1].split(":")[1].split()[0])
        except (OSError, IndexError, ValueError):
            return None
        per_cycle = 64 if " avx512f" in info else 32 if " fma" in info else 8
        return torch.get_num_threads() * mhz * 1e6 * per_cycle
    return None


# -----------------------------------------------------------------------------
# Hugging Face's config.json and tensor names for the families from_pretrained reads

LORA_TARGETS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}  # ours -> transformers'
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror}): a Hugging Face model folder needs it") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def open_safetensors(file):
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, "pt")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); download it again") from None


def safetensors_files(path):
    # the weights: one model.safetensors, or the shards its index names, in order
    if (path / "model.safetensors.index.json").exists():
        index = read_json(path / "model.safetensors.index.json")
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path}/model.safetensors.index.json has no weight_map: download it again")
        shards = sorted(set(index["weight_map"].values()))
        absent = [s for s in shards if not (path / s).exists()]
        if absent:
            raise ValueError(f"{path} lacks {absent[0]}, a shard its model.safetensors.index.json names")
        return [path / s for s in shards]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json (only safetensors "
                     f"weights are read: convert .bin weights first)")


def fingerprint(folder):
    """A short hash of a Hugging Face folder, to know a LoRA run's base again without reading all of it:
    its config.json, each safetensors file's size and header (names, shapes, offsets) and 64 KB from
    each of 32 places spread over it. Fine-tuning changes nearly every weight, so two bases differ here
    too; a change to a few tensors alone could pass unseen."""
    import hashlib
    digest = hashlib.sha256(json.dumps(read_json(Path(folder) / "config.json"), sort_keys=True).encode())
    for file in safetensors_files(Path(folder)):
        size = os.path.getsize(file)
        digest.update(str(size).encode())
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header, size)))
            for i in range(32):
                f.seek(i * size // 32)
                digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def config_from_hf(hf, block_size=None):
    """config.json as a dict -> GPTConfig, refusing in one line what GPT does not implement."""
    family = hf.get("model_type")
    if family not in HF_ARCHITECTURES:
        raise ValueError(f"model_type {family!r} is not supported (only {', '.join(HF_ARCHITECTURES)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("mlp_bias") or (family != "qwen2" and hf.get("attention_bias")):
        raise ValueError("biases on the attention output or the MLP (attention_bias/mlp_bias) are not supported")
    # The Hub's released models hold rope_theta and rope_scaling at the top level; transformers 5
    # writes both into rope_parameters. Either way, only the llama3 scaling (or none) is implemented.
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported (only llama3, or none)")
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = {k: rope[k] for k in keys}
    max_len = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if family == "mistral" or hf.get("use_sliding_window") else None
    if block_size is not None and block_size > max_len:
        raise ValueError(f"block_size={block_size} is past the model's max_position_embeddings={max_len}")
    if block_size is not None and window and window < block_size:
        raise ValueError(f"the model attends within a sliding_window of {window} tokens, which is not "
                         f"implemented: use block_size <= {window}")
    n_head = hf["num_attention_heads"]
    return GPTConfig(
        block_size=min(max_len, window or max_len), vocab_size=hf["vocab_size"],
        n_layer=hf["num_hidden_layers"], n_head=n_head, n_kv_head=hf.get("num_key_value_heads") or n_head,
        n_embd=hf["hidden_size"], head_size=hf.get("head_dim") or hf["hidden_size"] // n_head,
        mlp_hidden=hf["intermediate_size"], tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), rope_scaling=scaling,
        norm_eps=hf.get("rms_norm_eps", 1e-6), qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        family=family)


def hf_config(config, dtype, eos_token_id=None):
    # GPTConfig -> config.json in the Hub's style (rope_theta and rope_scaling at the top level),
    # which both transformers 4 and 5 and vLLM read
    c = config
    scaling = {**c.rope_scaling, "rope_type": "llama3"} if c.rope_scaling else None
    out = {"architectures": [HF_ARCHITECTURES[c.family]], "model_type": c.family, "vocab_size": c.vocab_size,
           "hidden_size": c.n_embd, "intermediate_size": c.mlp_hidden, "num_hidden_layers": c.n_layer,
           "num_attention_heads": c.n_head, "num_key_value_heads": c.n_kv_head, "head_dim": c.head_size,
           "hidden_act": "silu", "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps,
           "rope_theta": c.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": c.tie_embeddings,
           "attention_dropout": 0.0, "torch_dtype": str(dtype).removeprefix("torch."),
           "eos_token_id": eos_token_id}
    if c.family in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if c.family in ("mistral", "qwen2", "qwen3"):
        out.update(sliding_window=None, use_sliding_window=False)
    return out


def hf_layout(config):
    """{transformers' name: our parameter's name} for every tensor of a model of this config."""
    c = config
    out = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "norm_f.weight"}
    if not c.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    for i in range(c.n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out.update({hf + "input_layernorm.weight": ours + "norm1.weight",
                    hf + "post_attention_layernorm.weight": ours + "norm2.weight"})
        for theirs, mine in [("self_attn.q_proj", "attn.q"), ("self_attn.k_proj", "attn.k"),
                             ("self_attn.v_proj", "attn.v"), ("self_attn.o_proj", "attn.proj"),
                             ("mlp.gate_proj", "mlp.gate"), ("mlp.up_proj", "mlp.up"), ("mlp.down_proj", "mlp.down")]:
            out[hf + theirs + ".weight"] = ours + mine + ".weight"
        if c.qkv_bias:
            out.update({hf + f"self_attn.{x}_proj.bias": ours + f"attn.{x}.bias" for x in "qkv"})
        if c.qk_norm:
            out.update({hf + "self_attn.q_norm.weight": ours + "attn.q_norm.weight",
                        hf + "self_attn.k_norm.weight": ours + "attn.k_norm.weight"})
    return out
