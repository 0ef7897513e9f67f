"""
A model as one GGUF file for llama.cpp and Ollama: weights, hyperparameters and tokenizer, written with llama.cpp's
own gguf package (pip install gguf) and its name tables, for export.py's --to=NAME.gguf.
"""

import json

import torch

from lib.files import UserError
from lib.hf import check_exportable, hf_layout
from lib.tokenizer_json import bpe_merges, bpe_parts, byte_chars

# llama.cpp's architectures for the families model.py implements. Mistral is a Llama to llama.cpp.
ARCHITECTURES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "QWEN2", "qwen3": "QWEN3"}
# llama.cpp rotates the pairs (x[2i], x[2i + 1]) of a head for the llama architecture, and the halves
# (x[i], x[i + D/2]) as model.py and transformers do for Qwen's: q and k are reordered for the first.
INTERLEAVED_ROTARY = {"LLAMA"}
# gguf.LlamaFileType's names for the dtypes the matrices may be written in
FILE_TYPES = {torch.float32: "ALL_F32", torch.float16: "MOSTLY_F16", torch.bfloat16: "MOSTLY_BF16"}
# The split patterns of every byte-level BPE we make or import -> the name llama.cpp knows each by
# (tokenizer.ggml.pre). bpe:N (rustbpe's) and cl100k_base split the text exactly as Llama 3's does.
BYTELEVEL_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# llama.cpp's pre-tokenizers that split some text otherwise than the pattern named for them (llama.cpp's own
# tokenizer measured against tiktoken's on every word of o200k_base: 10,934 of 198,424 differ)
UNLIKE = {"gpt-4o": "splits some text otherwise than o200k_base (Hindi, Hebrew, Malayalam words; accented capitals: "
                    "'ÉS' as 'É', 'S'): prompts in them are tokens the model never saw together; a Hugging Face "
                    "export (--to=DIR) encodes as the data was"}
PRE_TOKENIZERS = {
    # tiktoken's gpt2, r50k_base and p50k_base
    r"'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s": "gpt-2",
    # tiktoken's cl100k_base
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"
    r"|\s++$|\s*[\r\n]|\s+(?!\S)|\s": "llama-bpe",
    # rustbpe's, which prepare.py's bpe:N learns with
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    # tiktoken's o200k_base
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+": "gpt-4o",
    # the tokenizer.json of Llama 3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "llama-bpe",
    # the tokenizer.json of Qwen2 and Qwen3: digits one at a time
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
    # GPT-2's, which a tokenizer.json's ByteLevel step splits with when it has no Split before it
    BYTELEVEL_SPLIT: "gpt-2",
}
INSTEAD = "export a Hugging Face folder and convert it with llama.cpp's convert_hf_to_gguf.py"


def write_gguf(model, tokenizer, path, dtype, ids, chat_template=None):
    """model (float32) + its data's tokenizer -> GGUF at path, matrices in dtype; ids: export.run_special_ids'.
    -> a warning where llama.cpp encodes some text otherwise than the tokenizer (UNLIKE), else None."""
    import gguf
    c = model.config
    check_exportable(c, model)
    if c.rope_scaling:
        raise UserError(f"Llama 3.1's rope scaling is not written to GGUF here: {INSTEAD}")
    tokens, types, merges, pre = vocabulary(tokenizer, c.vocab_size, gguf)
    arch = gguf.MODEL_ARCH[ARCHITECTURES[c.family]]
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.mlp_hidden)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.n_kv_head)
    writer.add_key_length(c.head_size)
    writer.add_value_length(c.head_size)
    writer.add_rope_dimension_count(c.head_size)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES[dtype]])
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for a byte-level BPE
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if tokenizer.bos_id is not None:  # llama.cpp adds the BOS it is told of: the one the data begins with
        ids = {**ids, "bos_token_id": tokenizer.bos_id}
    first = (lambda i: i[0] if isinstance(i, list) else i)  # Llama 3.1 lists several end ids: the first
    for name, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        if ids.get(name) is not None:
            add(first(ids[name]))
    # a prompt is encoded as prepare.py encoded a document: its tokenizer.json's BOS, or nothing, and no EOS
    writer.add_add_bos_token(tokenizer.bos_id is not None)
    writer.add_add_eos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    names, params = gguf.get_tensor_name_map(arch, c.n_layer), dict(model.named_parameters())
    for hf_name, ours in hf_layout(c).items():  # every weight, q and k reordered for an interleaved rotary
        tensor = params[ours].detach()
        if arch.name in INTERLEAVED_ROTARY and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            tensor = interleave_rotary(tensor, c.n_head if "q_proj" in hf_name else c.n_kv_head)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        # norms' weights stay float32, as llama.cpp's converter writes them; bfloat16 goes as its raw bits
        tensor = tensor.float() if tensor.dim() == 1 else tensor.to(dtype)
        if tensor.dtype == torch.bfloat16:
            writer.add_tensor(name, tensor.view(torch.int16).numpy(), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return f"warning: llama.cpp's {pre} pre-tokenizer {UNLIKE[pre]}" if pre in UNLIKE else None


def interleave_rotary(weight, heads):
    # each head's rows hold the first halves of its rotated pairs, then the second halves: alternated here
    return weight.reshape(heads, 2, -1, weight.shape[-1]).transpose(1, 2).reshape(weight.shape)


# -----------------------------------------------------------------------------
# the tokenizer: tokens in id order, their types, the merges, and the pre-tokenizer's name

def vocabulary(tokenizer, vocab_size, gguf):
    """(tokens, types, merges, pre) of a byte-level BPE, padded with unused tokens to the model's vocab_size."""
    instead = ("a character vocabulary has no GGUF tokenizer (nor a Hugging Face one): prepare the data with "
               "--tokenizer=bpe:N and train on it" if tokenizer.kind in ("char", "nanogpt_char") else INSTEAD)
    refusal = f"GGUF here takes byte-level BPE tokenizers only, not this {tokenizer.kind} one: {instead}"
    if tokenizer.kind == "huggingface":
        vocab, added, merges, pattern = hf_json_parts(json.loads(tokenizer.hf_json), refusal)
    elif tokenizer.kind in ("tiktoken", "bpe"):
        ranks, pattern, specials = bpe_parts(tokenizer)
        chars = byte_chars()
        spell = (lambda token: "".join(chars[b] for b in token))
        vocab = {spell(token): i for token, i in ranks.items()}
        merges = [f"{spell(a)} {spell(b)}" for a, b in bpe_merges(ranks)]
        added = {token: (i, True) for token, i in specials.items()}
    else:
        raise UserError(refusal)
    if pattern not in PRE_TOKENIZERS:
        raise UserError(f"llama.cpp knows no pre-tokenizer that splits as {pattern!r}: {INSTEAD}")
    if not merges:  # (gguf's writer leaves an empty list out, and llama.cpp refuses a BPE without the key)
        raise UserError("this BPE tokenizer has no merges, and llama.cpp reads none without: learn one with more "
                        "tokens than bytes (prepare.py --tokenizer=bpe:N, N above 256) on enough text")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    # Special tokens are control tokens; an added token that is not special is matched whole in text.
    kinds = {True: gguf.TokenType.CONTROL, False: gguf.TokenType.USER_DEFINED}
    entries = {**{t: (i, gguf.TokenType.NORMAL) for t, i in vocab.items()},
               **{t: (i, kinds[special]) for t, (i, special) in added.items()}}
    for token, (i, kind) in entries.items():
        if i >= vocab_size:
            raise UserError(f"the tokenizer's token {i} is past the model's vocab_size {vocab_size}")
        tokens[i], types[i] = token, kind
    return tokens, types, merges, PRE_TOKENIZERS[pattern]


def hf_json_parts(hf, refusal):
    """A byte-level BPE's tokenizer.json -> (vocab, {added: (id, special)}, merges "a b", split regex), or UserError."""
    model, pre = hf.get("model", {}), hf.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    bytelevel = [s for s in steps if s.get("type") == "ByteLevel"]
    splits = [s for s in steps if s.get("type") == "Split" and "Regex" in s.get("pattern", {})]
    if model.get("type") != "BPE" or model.get("byte_fallback") or len(bytelevel) != 1:
        raise UserError(refusal)
    # llama.cpp's byte-level BPE neither puts a space before a text nor normalizes it (but NFC: its converter's too)
    norm = hf.get("normalizer") or {}
    norms = norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    if bytelevel[0].get("add_prefix_space") or any(n.get("type") != "NFC" for n in norms):
        what = "puts a space before every text" if bytelevel[0].get("add_prefix_space") else "normalizes the text"
        raise UserError(f"this tokenizer.json {what}, which llama.cpp's byte-level BPE does not: a GGUF file would "
                        f"encode prompts otherwise than the data; export a Hugging Face folder instead")
    if splits and steps == [splits[0], bytelevel[0]] and not bytelevel[0].get("use_regex", True):  # split first
        pattern = splits[0]["pattern"]["Regex"]
    elif len(steps) == 1 and bytelevel[0].get("use_regex", True):
        pattern = BYTELEVEL_SPLIT
    else:
        raise UserError(refusal)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    added = {t["content"]: (t["id"], bool(t.get("special"))) for t in hf.get("added_tokens", [])}
    return model["vocab"], added, merges, pattern
