"""
The whole transformer in one file: a Llama-style GPT (RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, no biases).

    import torch
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    logits, _ = model(torch.randint(0, 256, (1, 16)))               # (1, 16, 256)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20)    # (1, 21)
"""

import inspect
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels

try:  # optional: only used on CUDA for bf16/fp16 tensors
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


@dataclass
class GPTConfig:
    block_size: int = 1024  # longest sequence the model is trained on
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

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head={self.n_head} must be divisible by n_kv_head={self.n_kv_head}")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head size n_embd/n_head={self.n_embd // self.n_head} must be even for rotary embeddings")


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


def rotary_tables(head_size, length, theta):
    # cos/sin for every position and frequency: (length, head_size/2), fp32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class Attention(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_size = config.n_embd // config.n_head
        kv_size = self.n_kv_head * self.head_size
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * kv_size, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x, cos, sin, cache=None):
        B, T, C = x.shape
        kv_size = self.n_kv_head * self.head_size
        q, k, v = self.qkv(x).split([C, kv_size, kv_size], dim=2)
        q = self.ops.apply_rotary(q.view(B, T, self.n_head, self.head_size), cos, sin)  # (B, T, H, D)
        k = self.ops.apply_rotary(k.view(B, T, self.n_kv_head, self.head_size), cos, sin)  # (B, T, Hkv, D)
        v = v.view(B, T, self.n_kv_head, self.head_size)
        if cache is not None:  # generation: prepend the keys and values of earlier positions
            if cache:
                k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
            cache[:] = [k, v]
        # a single query attends to the whole cache; otherwise queries and keys start together
        causal = T > 1
        dropout = self.dropout if self.training else 0.0
        if flash_attn_func is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            y = flash_attn_func(q, k, v, dropout_p=dropout, causal=causal)  # (B, T, H, D), GQA built in
        else:
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                dropout_p=dropout, is_causal=causal, enable_gqa=self.n_kv_head != self.n_head,
            ).transpose(1, 2)  # (B, T, H, D)
        return self.resid_dropout(self.proj(y.reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        # 2/3 of the classic 4x width keeps parameters equal to a GELU MLP; rounded up to 64
        hidden = 64 * math.ceil(8 * config.n_embd / 3 / 64)
        self.gate_up = nn.Linear(config.n_embd, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.ops = ops

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.dropout(self.down(self.ops.swiglu(gate, up)))


class Block(nn.Module):
    def __init__(self, config, ops):
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps, ops)
        self.attn = Attention(config, ops)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps, ops)
        self.mlp = MLP(config, ops)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache)
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
        cos, sin = rotary_tables(config.n_embd // config.n_head, config.block_size, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)  # derived from the config: not saved
        self.register_buffer("sin", sin, persistent=False)
        self.apply(self._init_weights)
        # scaled init of the projections into the residual stream (GPT-2 paper)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if non_embedding:
            n -= self.wte.weight.numel()
        return n

    def forward(self, idx, targets=None, cache=None):
        # idx: (B, T) token ids. With targets (B, T) it returns (None, mean loss) and never builds
        # the full logits; without, (logits (B, T, V), None). cache: list of n_layer lists, see generate.
        B, T = idx.shape
        start = cache[0][0].shape[1] if cache and cache[0] else 0  # positions already in the cache
        if start and T > 1:  # the causal mask below assumes queries and keys start together
            raise ValueError("with a filled cache, feed one token at a time")
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache[i] if cache is not None else None)
        x = self.norm_f(x)
        if targets is None:
            return self.lm_head(x), None
        loss = self.ops.linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.reshape(B * T))
        return None, loss

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

    def flops_per_token(self):
        # training FLOPs per token: 6N for the weights' matmuls plus attention's 12·L·H·Q·T (PaLM, B)
        c = self.config
        n = self.num_params(non_embedding=not c.tie_embeddings)  # the embedding lookup is no matmul
        return 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size

    def configure_optimizer(self, weight_decay, learning_rate, betas, device_type):
        # decay matrices only: norms' weights (and any other 1-D parameter) are left alone
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused or None)


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


def load_checkpoint(path, device="cpu"):
    # weights_only: a checkpoint is tensors and plain values; anything else is refused, and no code
    # in it runs. A damaged or foreign file is a ValueError with one line to show the user.
    import pickle
    import warnings
    try:
        with warnings.catch_warnings():  # torch warns about what it refused; our error says it in one line
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(f"{path} holds objects other than tensors and plain values; refusing to load it "
                         f"(only load checkpoints you trust, with code you have read)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise ValueError(f"{path} is not a readable checkpoint ({str(e).splitlines()[0]}); "
                         f"use another one, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt") from None


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
