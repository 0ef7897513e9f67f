"""
The transformer: a Llama-style GPT (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP, no biases
unless a Qwen2 brings them), its loss, attention masks, generation with a KV cache, and FLOPs. GPTConfig's fields
are settings a run can set (lib/settings.py) and its checkpoint records; README.md maps the other files.

    import torch
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64))
    logits, _ = model(torch.randint(0, 256, (1, 16)))               # (1, 16, 256)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 20)    # (1, 21)
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # optional: only used on CUDA for bf16/fp16 tensors
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None
# doc_mask's fast path on CUDA, imported and compiled when first needed (seconds): the attention, and its block mask
flex_attention = make_block_mask = None


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
    use_kernels: bool | None = None  # Triton fused ops; None: by the device each call runs on (fused)
    # What released models need beyond that (hf.load_pretrained sets them; the defaults are ours):
    head_size: int = 0  # width of one head; 0 means n_embd // n_head (Qwen3's is its own)
    mlp_hidden: int = 0  # SwiGLU width; 0 means 8/3 n_embd rounded up to a multiple of 64
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm on every head's q and k before rotary (Qwen3)
    rope_scaling: dict | None = None  # Llama 3.1's long-context frequencies (see rotary_tables)
    family: str = "llama"  # the Hugging Face model_type the weights came from and are saved as
    lora_rank: int = 0  # LoRA's adapters on the projections, 0: none (lora.py adds them and records them here)
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


# a block's seven projections, LoRA's name -> path in a Block; LoRA adapts, TP splits, hf.HF_PROJECTIONS names them
PROJECTIONS = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.proj", "gate": "mlp.gate", "up": "mlp.up",
               "down": "mlp.down"}


def fused(use_kernels, x, compiled_too=False):
    # kernels.py where a call runs its fused op, else None (the plain op below). use_kernels=None: fused on CUDA;
    # plain on a CPU (Triton would only interpret) and under torch.compile unless compiled_too, as Inductor fuses the
    # plain norm, SwiGLU and rotary into their neighbours, and only the fused loss wins (124M, H200: BENCHMARKS.md)
    if use_kernels or (use_kernels is None and x.is_cuda and (compiled_too or not torch.compiler.is_compiling())):
        import kernels  # here, where the option is taken: a run that fuses nothing (a CPU's) never reads kernels.py
        return kernels


# The plain ops kernels.py fuses; its references compute the same, so each kernel is tested against this model's.
def rms_norm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def apply_rotary(x, cos, sin):
    # as kernels.apply_rotary_ref, which says why the halves are rolled: x (B, T, H, D); cos, sin (T, D/2) fp32
    c, s = torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]  # (T, 1, D)
    xf = x.float()
    return (xf * c + xf.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)


def swiglu(gate, up):
    return F.silu(gate) * up


def linear_cross_entropy(x, weight, targets, ignore_index=-1):
    # (N, C) hidden states, (V, C) head, (N,) targets -> the mean loss over targets not ignored (0 where none)
    loss = F.cross_entropy((x @ weight.t()).float(), targets, ignore_index=ignore_index, reduction="sum")
    return loss / (targets != ignore_index).sum().clamp(min=1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, use_kernels):
        super().__init__()
        self.eps, self.use_kernels = eps, use_kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        kernels = fused(self.use_kernels, x)
        return (kernels.rms_norm if kernels else rms_norm)(x, self.weight, self.eps)


def rotary_tables(head_size, length, theta, scaling=None):
    # cos/sin for every position and frequency: (length, head_size/2), fp32
    inv_freq = 1.0 / theta ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size)
    if scaling:  # Llama 3.1: slow frequencies divided by factor, fast ones kept, a smooth ramp between
        wavelen = 2 * math.pi / inv_freq
        context = scaling["original_max_position_embeddings"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        ramp = (context / wavelen - low) / (high - low)
        ramp = ramp.clamp(0, 1)  # 0 for wavelengths past context/low_freq_factor, 1 below context/high_freq_factor
        inv_freq = (1 - ramp) * inv_freq / scaling["factor"] + ramp * inv_freq
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def adapted(linear, x):
    # a projection's output, plus its adapter's where lora.py gave it one (linear.lora)
    y = linear(x)
    return y if getattr(linear, "lora", None) is None else y + linear.lora(x).to(y.dtype)


def attend(q, k, v, **kwargs):
    # SDPA on (B, T, H, D) tensors, in fp32 under a CPU's bf16 autocast: there its bf16 backward is several times
    # slower (BENCHMARKS.md). q.is_cpu, not q.device: memory.py's fake CPU trace answers is_cpu for the device planned.
    if q.is_cpu and torch.is_autocast_enabled("cpu"):
        with torch.autocast("cpu", enabled=False):
            return attend(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          **kwargs).transpose(1, 2)


def attention(q, k, v, mask, dropout, causal):
    # (B, T, H, D) queries over (B, S, Hkv, D) keys and values -> (B, T, H, D): FlexAttention for a block mask
    # (documents on CUDA), SDPA for a boolean (B, 1, T, S) one, else flash-attn where it can run, or SDPA
    gqa = k.size(2) != q.size(2)
    if mask is not None and not isinstance(mask, torch.Tensor):
        # FlexAttention runs outside autocast and wants q, k and v in one dtype: autocast's where it is on, as SDPA
        # would compute in. qk-norm with fp32 norm weights (a Qwen3 fully fine-tuned) makes q and k fp32 beside a
        # bf16 v, which it refuses, or on newer builds runs wholly in fp32 with a much slower backward.
        dtype = torch.get_autocast_dtype(v.device.type) if torch.is_autocast_enabled(v.device.type) else v.dtype
        q, k, v = (t.to(dtype) for t in (q, k, v))
        return flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,
                              enable_gqa=gqa).transpose(1, 2)
    if q.is_cuda:  # the dtype a GPU computes in (autocast's where it is on)
        half = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else q.dtype
        if gqa and (mask is not None or half not in (torch.bfloat16, torch.float16)):
            # SDPA's GQA runs only in its flash kernel (half, no mask) or its math one, which keeps each head's (T, S)
            # scores for the backward: the keys and values repeated for every query head run its memory-efficient one
            (k, v), gqa = (t.repeat_interleave(q.size(2) // t.size(2), 2) for t in (k, v)), False
    if mask is not None:  # True where a query looks
        return attend(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
    if flash_attn_func is not None and q.is_cuda:  # flash-attn: on a GPU, in bf16 or fp16 (autocast's if on)
        if half in (torch.bfloat16, torch.float16):
            return flash_attn_func(q.to(half), k.to(half), v.to(half), dropout_p=dropout, causal=causal)  # GQA too
    return attend(q, k, v, dropout_p=dropout, is_causal=causal, enable_gqa=gqa)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_size = config.n_head, config.n_kv_head, config.head_size
        q_size, kv_size = self.n_head * self.head_size, self.n_kv_head * self.head_size
        # separate projections (not one fused qkv): tensor parallel splits each by heads
        self.q = nn.Linear(config.n_embd, q_size, bias=config.qkv_bias)
        self.k = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.v = nn.Linear(config.n_embd, kv_size, bias=config.qkv_bias)
        self.proj = nn.Linear(q_size, config.n_embd, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.norm_eps, config.use_kernels)
            self.k_norm = RMSNorm(self.head_size, config.norm_eps, config.use_kernels)
        self.qk_norm, self.dropout, self.use_kernels = config.qk_norm, config.dropout, config.use_kernels
        self.resid_dropout = nn.Dropout(config.dropout)
        # tensor parallel's attention (parallelize sets it), whose dropout draws this process's heads' own masks
        self.attend_in_stream = None

    def forward(self, x, cos, sin, cache=None, mask=None):
        B, T, C = x.shape
        # head counts from the shapes: under tensor parallel a process holds only its share of the heads
        q, k, v = (adapted(p, x).view(B, T, -1, self.head_size) for p in (self.q, self.k, self.v))  # (B, T, H|Hkv, D)
        if self.qk_norm:  # each with its own weight
            q, k = self.q_norm(q), self.k_norm(k)
        kernels = fused(self.use_kernels, x)
        rotate = kernels.apply_rotary if kernels else apply_rotary
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # apart: joining them costs a copy forward and backward
        if cache is not None:  # generation: prepend the keys and values of earlier positions
            if cache:
                k, v = torch.cat([cache[0], k], dim=1), torch.cat([cache[1], v], dim=1)
            cache[:] = [k, v]
        # a single query attends to the whole cache; otherwise queries and keys start together
        dropout = self.dropout if self.training else 0.0
        attend = self.attend_in_stream if dropout and self.attend_in_stream is not None else attention
        y = attend(q, k, v, mask, dropout, causal=T > 1)
        return self.resid_dropout(adapted(self.proj, y.reshape(B, T, -1)))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        # by default 2/3 of the classic 4x width, which keeps parameters equal to a GELU MLP
        self.gate = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.up = nn.Linear(config.n_embd, config.mlp_hidden, bias=False)
        self.down = nn.Linear(config.mlp_hidden, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)
        self.use_kernels = config.use_kernels

    def forward(self, x):
        gate, up, kernels = adapted(self.gate, x), adapted(self.up, x), fused(self.use_kernels, x)
        return self.dropout(adapted(self.down, (kernels.swiglu if kernels else swiglu)(gate, up)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = RMSNorm(config.n_embd, config.norm_eps, config.use_kernels)
        self.attn = Attention(config)
        self.norm2 = RMSNorm(config.n_embd, config.norm_eps, config.use_kernels)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, mask=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache, mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.norm_f = RMSNorm(config.n_embd, config.norm_eps, config.use_kernels)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.register_buffer("cos", None, persistent=False)  # derived from the config: not saved
        self.register_buffer("sin", None, persistent=False)
        self.materialize()
        for module in self.modules():  # the leaves in the order nn.Module.apply would visit them
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():  # the projections into the residual stream: scaled init (GPT-2)
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def num_params(self, non_embedding=False):
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, cache=None, doc_ids=None, mask=None):
        # idx: (B, T) token ids -> (logits (B, T, V), None), or with targets (B, T), (None, mean loss); the fused loss
        # (kernels.linear_cross_entropy, as fused() picks) never holds all (B*T, V) logits at once. cache: a list per
        # layer (generate), and the logits of the last position alone (B, 1, V): a long prompt's (T, V) are never made.
        # doc_ids: (B, T) document ids of packed sequences: a token sees only its document's tokens up to itself (not
        # with a cache). mask: instead, doc_ids' attention_mask made outside a compiled model (train.py).
        x = self.hidden(idx, cache, doc_ids, mask)
        if targets is None:
            return self.lm_head(x if cache is None else x[:, -1:]), None
        kernels = fused(self.config.use_kernels, x, compiled_too=True)
        return None, (kernels.linear_cross_entropy if kernels else linear_cross_entropy)(
            x.view(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))

    def hidden(self, idx, cache=None, doc_ids=None, mask=None):
        # the final normed hidden states (B, T, C), on which the LM head computes the logits
        B, T = idx.shape
        start = cache[0][0].shape[1] if cache and cache[0] else 0  # positions already in the cache
        if start and T > 1:  # the causal mask below assumes queries and keys start together
            raise ValueError("with a filled cache, feed one token at a time")
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} tokens is longer than block_size={self.config.block_size}")
        if (doc_ids is not None or mask is not None) and cache is not None:
            raise ValueError("doc_ids masks training and evaluation sequences; generation takes no doc_ids")
        if doc_ids is not None and mask is None:
            mask = self.attention_mask(doc_ids)
        cos, sin = self.cos[start:start + T], self.sin[start:start + T]
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cache[i] if cache is not None else None, mask)
        return self.norm_f(x)

    def attention_mask(self, doc_ids):
        return document_mask(doc_ids, flex=doc_ids.is_cuda and not (self.training and self.config.dropout > 0))

    @torch.no_grad()
    def loss_and_accuracy(self, idx, targets, doc_ids=None, chunk_elements=2**24):
        """(mean loss, next-token accuracy) over the targets that are not -1, as 0-d tensors. The logits
        are built a chunk of rows at a time (chunk_elements of them, 64 MB in fp32), never all at once."""
        x = self.hidden(idx, doc_ids=doc_ids)
        x, targets = x.view(-1, x.size(-1)), targets.reshape(-1)
        rows = max(1, chunk_elements // self.config.vocab_size)
        loss_sum, correct = torch.zeros((), device=x.device), torch.zeros((), device=x.device, dtype=torch.long)
        for i in range(0, len(targets), rows):
            logits, t = self.lm_head(x[i:i + rows]).float(), targets[i:i + rows]  # (rows, V), (rows,)
            loss_sum += F.cross_entropy(logits, t, ignore_index=-1, reduction="sum")
            correct += (logits.argmax(dim=-1) == t).sum()  # an ignored target (-1) is never the argmax
        n = (targets != -1).sum().clamp(min=1)
        return loss_sum / n, correct / n

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, stop=None, vocab=None,
                 document=None):
        # idx: (B, T) -> idx with max_new_tokens sampled tokens appended (fewer once every row has written the token
        # id stop, or one of the ids stop lists), through a KV cache. Past block_size the window slides: the cache is
        # rebuilt from the last block_size tokens, so each step sees what a full forward would. vocab: the tokenizer's
        # size; ids past it are never drawn.
        # document: the id that begins a document (a doc_mask run's end-of-text, one row): a step sees the tokens from
        # the last one on, as doc_mask trained and evaluates it, not the documents before.
        if document is not None and idx.shape[0] != 1:
            raise ValueError("generate(document=) takes one row")
        cache = None
        stops = None if stop is None else torch.as_tensor(stop, device=idx.device)  # made once
        stopped = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)  # rows that wrote a stop id
        begins = (idx[0] == document).nonzero() if document is not None else []
        begin = int(begins[-1]) if len(begins) else 0  # where the last document begins
        for _ in range(max_new_tokens):
            window = min(idx.shape[1] - begin, self.config.block_size)  # a cache of the last block_size tokens
            fresh = cache is None or idx.shape[1] - begin > self.config.block_size
            cache = [[] for _ in self.blocks] if fresh else cache
            logits, _ = self(idx[:, -window:] if fresh else idx[:, -1:], cache=cache)
            logits = logits[:, -1, :vocab].float()  # (B, V)
            if temperature < 1e-5:  # greedy: 0, or so low that the logits divided by it would overflow
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
                idx_next = torch.multinomial(probs, num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            if document is not None and int(idx_next) == document:  # a new document: its own context from here
                begin, cache = idx.shape[1] - 1, None
            if stops is not None:  # (each new token looked at once, not every token so far at every step)
                stopped |= torch.isin(idx_next[:, 0], stops)
                if stopped.all():
                    break
        return idx

    def flops_per_token(self, seq_len=None, keys=None):
        # Training FLOPs per token: 6N for the weights' matmuls (4 for a frozen weight, LoRA's base: no gradient)
        # plus attention's 12·L·H·Q per key a query meets: by default every key of a T-token sequence (T: seq_len or
        # block_size), PaLM's convention (appendix B), nanoGPT's and nanochat's for MFU. keys, for the FLOPs run: the
        # mean a query meets where attention runs masked (causal: (T + 1) / 2; by document: metrics.attended_keys).
        c = self.config
        n = self.num_params(non_embedding=not c.tie_embeddings)  # the embedding lookup is no matmul
        frozen = sum(p.numel() for name, p in self.named_parameters()
                     if not p.requires_grad and (c.tie_embeddings or name != "wte.weight"))
        keys = keys if keys is not None else seq_len or c.block_size
        return 6 * n - 2 * frozen + 12 * c.n_layer * c.n_head * c.head_size * keys

    def materialize(self):
        # rotary tables (derived) and the tied head: at build, and after filling a meta-device build (which unties them)
        c = self.config
        self.cos, self.sin = rotary_tables(c.head_size, c.block_size, c.rope_theta, c.rope_scaling)
        if c.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        return self

    def projections(self):
        # (block index, short name, nn.Linear) for each of every block's seven projections (PROJECTIONS)
        for i, block in enumerate(self.blocks):
            for name, path in PROJECTIONS.items():
                yield i, name, block.get_submodule(path)


def document_mask(doc_ids, flex=False):
    """doc_ids (B, T) -> the mask letting a token see only itself and earlier tokens of its own document:
    FlexAttention's block mask (flex, on CUDA; it has no dropout), else a (B, 1, T, T) boolean one for SDPA. A
    compiled model takes it made outside (GPT.forward's mask): a new block mask each batch recompiles it."""
    global flex_attention, make_block_mask
    B, T = doc_ids.shape
    if flex:
        from torch.nn.attention import flex_attention as flex
        if flex_attention is None:  # compiled, it is a fused kernel; eager, it would build the full scores
            flex_attention = torch.compile(flex.flex_attention, dynamic=False)
            # and the block mask, which eager makes from a whole (B, T, T) mask (10 bytes a pair: 10 GiB at 32k)
            make_block_mask = torch.compile(flex.create_block_mask)

        def causal_in_document(b, h, q, k):
            return (k <= q) & (doc_ids[b, q] == doc_ids[b, k])
        # made alike in training and evaluation (grad mode and autocast are in its compiled graph's guards)
        with torch.no_grad(), torch.autocast(doc_ids.device.type, enabled=False):
            return make_block_mask(causal_in_document, B, None, T, T, device=doc_ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]  # (B, 1, T, T)


def filter_logits(logits, top_k=None, top_p=None):
    # logits: (B, V). Keep the top_k largest (0 or None: all) and the smallest set whose probability reaches top_p.
    if top_k:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches top_p
        drop[:, 0] = False  # the likeliest token stays (top_p=0 keeps it alone)
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits
