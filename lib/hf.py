"""
Hugging Face model folders (Llama, Mistral, Qwen2, Qwen3) in and out: config.json <-> GPTConfig, transformers'
tensor names <-> ours, safetensors files (one, or shards with an index), and a fingerprint that knows a folder.

    from lib.hf import load_pretrained, save_pretrained
    model = load_pretrained("models/Qwen3-0.6B")          # a GPT with the folder's weights
    save_pretrained(model, "models/copy")                  # config.json + model.safetensors
"""

import hashlib
import json
import os
from dataclasses import fields, replace
from functools import partial
from pathlib import Path

import torch

from lib.bounds import check_shapes, confined, layer_count
from lib.files import UserError, check_regular, open_own, read_json
from lib.settings import LLAMA3_SCALING, check_sizes
from model import GPT, PROJECTIONS, GPTConfig

# ours -> transformers' names of a block's seven projections (model.PROJECTIONS), and of the families
HF_PROJECTIONS = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                  "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
# config.json's names of the model's settings (hf_config writes them; config_from_hf reads them, with defaults)
HF_NAMES = {"block_size": "max_position_embeddings", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size", "head_size": "head_dim",
            "mlp_hidden": "intermediate_size", "norm_eps": "rms_norm_eps"}
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM"}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def open_safetensors(file):
    from safetensors import SafetensorError, safe_open
    try:
        return safe_open(file, "pt")
    except SafetensorError as e:
        raise UserError(f"{file} is not a readable safetensors file ({e}); download it again") from None


def header_shapes(files):
    """({tensor name: shape} from the files' headers alone, the first tensor's dtype); UserError for a file
    without tensors, or a tensor that is not in a floating-point dtype we compute in (float8 is not)."""
    shapes, first = {}, None
    for file in files:
        with open_safetensors(file) as f:
            if not f.keys():
                raise UserError(f"{file} holds no tensors: download it again")
            for name in f.keys():
                kind = f.get_slice(name).get_dtype()
                if not name.endswith("rotary_emb.inv_freq") and kind not in ("F64", *SAFETENSORS_DTYPES):
                    raise UserError(f"{name} in {file} holds {kind} values, not float32, bfloat16 or float16 "
                                    f"weights: download the model again (a quantized one: its unquantized release)")
                shapes[name], first = f.get_slice(name).get_shape(), first or kind
    return shapes, first


def safetensors_files(path):
    # the weights: one model.safetensors, or the shards its index names, in order
    if (path / "model.safetensors.index.json").exists():
        index = read_json(path / "model.safetensors.index.json")
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise UserError(f"{path}/model.safetensors.index.json has no weight_map: download it again")
        where = path / "model.safetensors.index.json"  # its files are read only from inside the folder
        shards = sorted({confined(path, name, where) for name in index["weight_map"].values()})
        absent = [s for s in shards if not s.exists()]
        if absent:
            raise UserError(f"{path} lacks {absent[0].name}, a shard its model.safetensors.index.json names")
        return shards
    if (path / "model.safetensors").exists():
        check_regular(path / "model.safetensors", "download the model again")
        return [path / "model.safetensors"]
    raise UserError(f"{path} has no model.safetensors or model.safetensors.index.json (only safetensors "
                     f"weights are read: convert .bin weights first)")


MAX_HEADER = 100 << 20  # bytes of a safetensors header, as the safetensors library reads one at most


def fingerprint(folder):
    """A short hash to know a LoRA run's base again without reading it all: config.json, each safetensors file's
    size, header and 64 KB at 32 places (fine-tuning changes nearly every weight; a few changed ones could pass)."""
    digest = hashlib.sha256(json.dumps(read_json(Path(folder) / "config.json"), sort_keys=True).encode())
    for file in safetensors_files(Path(folder)):
        size = os.path.getsize(file)
        digest.update(str(size).encode())
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header, size, MAX_HEADER)))  # (a file claiming more: load_pretrained refuses it)
            for i in range(32):
                f.seek(i * size // 32)
                digest.update(f.read(1 << 16))
    return digest.hexdigest()[:16]


def config_from_hf(hf, block_size=None):
    """config.json as a dict -> GPTConfig, refusing in one line what GPT does not implement."""
    family = hf.get("model_type")
    if family not in HF_ARCHITECTURES:
        gpt2 = ": GPT-2's blocks (learned positions, LayerNorm, GELU, biases) are nanoGPT's, not this model's" \
            if family == "gpt2" else ""
        raise UserError(f"model_type {family!r} is not supported (only {', '.join(HF_ARCHITECTURES)}){gpt2}; start "
                         f"from a folder of one of those")
    if hf.get("quantization_config"):  # FP8, GPTQ, AWQ, bitsandbytes: weights that mean nothing without their scales
        method = hf["quantization_config"].get("quant_method") if isinstance(hf["quantization_config"], dict) else None
        raise UserError(f"config.json says quantization_config ({method}): a quantized release, whose weights this "
                         f"model.py does not read; start from the unquantized model (lora_base_dtype='nf4' or 'int8' "
                         f"quantizes it here)")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):  # (the same function: transformers' ACT2FN)
        raise UserError(f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    # (transformers reads these two for Llama, attention_bias for Qwen3; Mistral and Qwen2 have fixed biases)
    if any(hf.get(k) for k in {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",)}.get(family, ())):
        raise UserError("biases on the attention output or the MLP (attention_bias/mlp_bias) are not supported")
    # the Hub's released models hold rope_theta and rope_scaling at the top level, transformers 5 rope_parameters;
    # where both are there, transformers reads rope_scaling whole (with the top-level rope_theta), not rope_parameters
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"rope scaling {rope_type!r} is not supported (only llama3, or none)")
    scaling = {k: rope.get(k) for k in LLAMA3_SCALING} if rope_type == "llama3" else None  # (checked below)
    max_len = hf.get("max_position_embeddings", 2048)
    # within 4,096 tokens where config.json does not say (transformers' default); null: none. Qwen's only if switched on
    window = hf.get("sliding_window", 4096) if family == "mistral" or hf.get("use_sliding_window") else None
    if block_size is not None and block_size > max_len:
        raise UserError(f"block_size={block_size} is past the model's max_position_embeddings={max_len}")
    if block_size is not None and window and window < block_size:
        raise UserError(f"the model attends within a sliding_window of {window} tokens, which is not "
                         f"implemented: use block_size <= {window}")
    sizes = dict(block_size=min(max_len, window or max_len), vocab_size=hf["vocab_size"],
                 n_layer=hf["num_hidden_layers"], n_head=hf["num_attention_heads"],
                 n_kv_head=hf.get("num_key_value_heads") or 0, n_embd=hf["hidden_size"],
                 head_size=hf.get("head_dim") or 0, mlp_hidden=hf["intermediate_size"],
                 rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
                 norm_eps=hf.get("rms_norm_eps", 1e-6))
    # config.json is data: its sizes are checked before GPTConfig divides one by another
    check_sizes({**sizes, "rope_scaling": scaling}, "config.json", "fix it, or download the model again", HF_NAMES)
    sizes["rope_theta"] = float(sizes["rope_theta"])
    return GPTConfig(**sizes, tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_scaling=scaling,
                     qkv_bias=family == "qwen2", qk_norm=family == "qwen3", family=family)


def special_ids(folder):
    """The bos, eos and pad token ids a folder's config.json has, for an export of a fine-tune of it."""
    hf = read_json(Path(folder) / "config.json")
    return {name: hf[name] for name in ("bos_token_id", "eos_token_id", "pad_token_id") if name in hf}


def eos_ids(folder, tokenizer, names=("tokenizer_config.json", "generation_config.json")):
    """The ids a Hugging Face folder's model ends a text with, as transformers reads them: tokenizer_config.json's
    eos_token first (Qwen3's <|im_end|>, where tokenizer.eot_id is <|endoftext|>), then generation_config.json's
    (names: of these files, those to read)."""
    ids, specials = [], tokenizer.special_tokens()
    for name, key in (("tokenizer_config.json", "eos_token"), ("generation_config.json", "eos_token_id")):
        said = read_json(Path(folder) / name).get(key) if name in names and (Path(folder) / name).is_file() else None
        said = said.get("content") if isinstance(said, dict) else said
        ids += [specials.get(i) if isinstance(i, str) else i for i in (said if isinstance(said, list) else [said])]
    return list(dict.fromkeys(i for i in ids if type(i) is int and 0 <= i < tokenizer.vocab_size))


def folder_splits_special(folder, missing=False):
    """Whether transformers reads a special token's spelling in a text as text with this folder's tokenizer:
    tokenizer_config.json's split_special_tokens (False where it does not say; missing where there is no such file)."""
    path = Path(folder) / "tokenizer_config.json"
    return read_json(path).get("split_special_tokens") is True if path.is_file() else missing


# GPTConfig's fields that config.json says (hf_config), or that no weight's meaning depends on (dropout, kernels, LoRA)
SAID = {"block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "tie_embeddings", "rope_theta",
        "norm_eps", "head_size", "mlp_hidden", "qkv_bias", "qk_norm", "rope_scaling", "family", "dropout",
        "use_kernels", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets"}


def check_exportable(config, model=None):
    """UserError for a GPTConfig that sets a field config.json cannot say (SAID), or whose attention is not its
    family's: config.json says q, k and v biases by naming Qwen2, and q and k norms by naming Qwen3; or for a model
    (model.py as edited) with a parameter a folder has no place for, or without one it has (check_layout)."""
    unsaid = [f"{f.name}={getattr(config, f.name)!r}" for f in fields(config) if f.name not in SAID
              and getattr(config, f.name) != f.default]
    if unsaid:
        raise UserError(f"this model's {', '.join(unsaid)} has no Hugging Face config.json field: transformers, "
                        f"vLLM and llama.cpp would run another model (sample it with sample.py instead)")
    for field, family in (("qkv_bias", "qwen2"), ("qk_norm", "qwen3")):
        if getattr(config, field) != (config.family == family):
            raise UserError(f"this model's {field}={getattr(config, field)} with family={config.family!r}: "
                            f"config.json says {field} only by naming {family} as the family, so transformers, vLLM "
                            f"and llama.cpp would run another model (train with family='{family}' and {field}=True "
                            f"or neither; sample this one with sample.py)")
    if model is not None:
        check_layout(model, "a Hugging Face folder", "transformers, vLLM and llama.cpp would run another model "
                     "(sample it with sample.py instead)")


def check_layout(model, where, fix):
    """UserError where model (model.py's, as edited) and a Hugging Face folder's weights (hf_layout) are not the same
    parameters: read from one, a parameter the folder lacks would start as whatever memory held; written, left out."""
    ours, theirs = {n for n, _ in model.named_parameters() if ".lora." not in n}, set(hf_layout(model.config).values())
    if ours - theirs:
        raise UserError(f"this model.py's {min(ours - theirs)} has no place in {where}: {fix}")
    if theirs - ours:
        raise UserError(f"{where} would fill {min(theirs - ours)}, which this model.py does not have: {fix}")


def hf_config(config, dtype, ids=None):
    # GPTConfig -> config.json in the Hub's style, which transformers 4 and 5 and vLLM read; ids: special_ids's
    c = config
    check_exportable(c)
    scaling = {**c.rope_scaling, "rope_type": "llama3"} if c.rope_scaling else None
    out = {"architectures": [HF_ARCHITECTURES[c.family]], "model_type": c.family, "vocab_size": c.vocab_size,
           **{name: getattr(c, ours) for ours, name in HF_NAMES.items()}, "hidden_act": "silu",
           "rope_theta": c.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": c.tie_embeddings,
           "attention_dropout": 0.0, "torch_dtype": str(dtype).removeprefix("torch."), **(ids or {})}
    if c.family in ("llama", "qwen3"):
        out.update(attention_bias=False)
    if c.family in ("mistral", "qwen2", "qwen3"):
        out.update(sliding_window=None, use_sliding_window=False)
    return out


def hf_layout(config):
    """{transformers' name: our parameter's name} for every tensor of a model of this config."""
    out = {"model.embed_tokens.weight": "wte.weight", "model.norm.weight": "norm_f.weight"}
    if not config.tie_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    for i in range(config.n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out.update({hf + "input_layernorm.weight": ours + "norm1.weight",
                    hf + "post_attention_layernorm.weight": ours + "norm2.weight"})
        for short, theirs in HF_PROJECTIONS.items():
            out[hf + theirs + ".weight"] = ours + PROJECTIONS[short] + ".weight"
        if config.qkv_bias:
            out.update({hf + f"self_attn.{x}_proj.bias": ours + f"attn.{x}.bias" for x in "qkv"})
        if config.qk_norm:
            out.update({hf + f"self_attn.{x}_norm.weight": ours + f"attn.{x}_norm.weight" for x in "qk"})
    return out


# -----------------------------------------------------------------------------
# a folder -> GPT, and GPT -> a folder


def load_pretrained(path, dtype=None, block_size=None, weights=True, quantized=None, device=None, **overrides):
    """A folder (config.json + safetensors) -> GPT, one copy of the weights in memory. dtype: None keeps the weights';
    block_size: the longest sequence it will get, checked against the model's limit (config.block_size stays that);
    not weights: the model on the meta device, checked against the files' headers, its weights never read;
    quantized ('nf4', 'int8'): the projections' weights quantized on device as they are read (lora.quantize_weight),
    never all held in dtype (a 70B base: 140 GB of host memory in every process), the rest on the CPU."""
    path = Path(path)
    if set(overrides) - {"dropout", "use_kernels"}:
        raise UserError(f"load_pretrained takes dropout and use_kernels, not {sorted(overrides)} (LoRA: add_lora)")
    hf = read_json(path / "config.json")
    try:
        config = replace(config_from_hf(hf, block_size), **overrides)
    except KeyError as e:
        raise UserError(f"{path / 'config.json'} lacks {e}, which a {hf.get('model_type')} model needs") from None
    except (TypeError, AttributeError) as e:  # a list for a number, a string for the whole config, ...
        raise UserError(f"{path / 'config.json'} holds a value of the wrong kind ({e}): fix it, or download "
                         f"the model again") from None
    except UserError:
        raise
    except ValueError as e:  # sizes GPTConfig refuses (a width not a multiple of the heads, ...)
        raise UserError(f"{path / 'config.json'}: {e}: fix it, or download the model again") from None
    files = safetensors_files(path)
    shapes, stored = header_shapes(files)
    dtype = dtype or SAFETENSORS_DTYPES.get(stored, torch.float32)  # the first tensor's is the folder's
    # config.json's sizes must be the weights' before any memory is taken: the model is built on the meta device
    fix = "fix config.json, or download the model again"
    if layer_count(shapes, "model.layers.") != config.n_layer:
        raise UserError(f"config.json says num_hidden_layers={config.n_layer}, but {path}'s weights hold "
                         f"{layer_count(shapes, 'model.layers.')} layers: {fix}")
    with torch.device("meta"):
        model = GPT(config)
    layout = hf_layout(config)
    check_layout(model, f"{path}'s weights", "train an edited model.py from scratch, or give the parameter its "
                 "starting value in lib/hf.py's load_pretrained (hf_layout)")
    check_shapes(model, shapes, layout, path, fix)
    absent = sorted(set(layout) - set(shapes))
    if absent:
        raise UserError(f"{path} lacks {len(absent)} tensor(s) the config needs, e.g. {absent[0]}")
    model = model.to(dtype)
    if not weights:
        return model
    params, lazy = dict(model.named_parameters()), {}  # (a lazy one stays on the meta device until read)
    for i, short, linear in model.projections() if quantized else ():  # quantized on device as read, never all in dtype
        from lib.lora import quantize_weight
        lazy[f"blocks.{i}.{PROJECTIONS[short]}.weight"] = partial(quantize_weight, linear, kind=quantized,
                                                                  device=device)
        del linear.weight
    model = model.to_empty(device="cpu").materialize()
    params.update(model.named_parameters())
    for file in files:
        fill(model, file, layout, params, lazy)
    if config.tie_embeddings:
        check_tied_head(files, model.wte.weight)
    return model


def fill(model, file, layout, params, lazy):
    # params ({our name: parameter}) filled from a safetensors file of a folder ({its name: ours}: layout); a lazy one
    # ({our name: what holds it}: load_pretrained's quantized projections) is given its tensor in the params' dtype
    with open_safetensors(file) as f, torch.no_grad():
        for name in f.keys():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and model.config.tie_embeddings):
                continue  # derived from the config, or the tied embedding stored twice
            if name not in layout:
                raise UserError(f"{file} holds {name}, which this model.py does not implement")
            target = params[layout[name]]
            tensor = f.get_tensor(name)
            if tensor.shape != target.shape:
                raise UserError(f"{name} in {file} has shape {tuple(tensor.shape)}, but config.json "
                                 f"implies {tuple(target.shape)}")
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():  # NaN would only show later
                raise UserError(f"{name} in {file} holds a NaN or an infinite value: download the model "
                                f"again, or use another")
            if layout[name] in lazy:
                lazy[layout[name]](tensor.to(target.dtype))
            else:
                target.copy_(tensor)


def check_tied_head(files, embedding):
    # a tied model's lm_head.weight, where a file holds one, must be its embedding: transformers 5 unties another
    # one and computes with it, transformers 4 and vLLM drop it (two models in one folder)
    for file in files:
        with open_safetensors(file) as f:
            head = f.get_tensor("lm_head.weight") if "lm_head.weight" in f.keys() else None
            if head is not None and not torch.equal(head.to(embedding.dtype), embedding):
                raise UserError(f"config.json says tie_word_embeddings, but {file} holds an lm_head.weight unlike "
                                f"the embedding: set tie_word_embeddings to false if it is the model's head, else "
                                f"remove it")


def save_pretrained(model, path, max_shard_bytes=5 * 2**30, ids=None):
    """config.json + model.safetensors (shards past max_shard_bytes) in the model's dtype; ids: special_ids'."""
    from huggingface_hub import save_torch_state_dict
    if model.config.lora_rank or any(hasattr(p, "get_original_weight") for p in model.parameters()):
        raise UserError("save_pretrained writes plain weights: merge_lora() first, and load a 4-bit base "
                         "again unquantized (export.py does both)")
    check_exportable(model.config, model)
    config, path = hf_config(model.config, model.wte.weight.dtype, ids), Path(path)  # (refused: nothing written)
    path.mkdir(parents=True, exist_ok=True)
    with open_own(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    params = dict(model.named_parameters())
    weights = {hf: params[ours].detach().to("cpu") for hf, ours in hf_layout(model.config).items()}
    save_torch_state_dict(weights, path, max_shard_size=max_shard_bytes)
