"""
Export a training run as a Hugging Face folder that transformers, vLLM and llama.cpp's converter read:
config.json, model.safetensors (shards past 5 GB) and the tokenizer (tokenizer.json and
tokenizer_config.json), which encodes exactly as the data the model was trained on. A LoRA run is
merged into its base (W + alpha/rank B A, in fp32, then cast), or written alone as a peft adapter.

    python export.py --out_dir=out-finetune --to=models/finetuned
    python export.py --out_dir=out-finetune --ckpt=ckpt_best.pt --to=models/finetuned --dtype=bfloat16
    python export.py --out_dir=out-lora --to=adapters/mine --adapter    # peft: adapter_config.json + weights

Then: AutoModelForCausalLM.from_pretrained("models/finetuned") and AutoTokenizer.from_pretrained(...), or
PeftModel.from_pretrained(base_model, "adapters/mine").
"""

import argparse
import json
import os
import re
import shutil
import sys

# -----------------------------------------------------------------------------
# a run's checkpoint -> the model and the tokenizer of its data (sample.py reads runs this way too)


def load_run(path, device="cpu", data_dir=None):
    """out_dir/ckpt.pt -> (model, tokenizer, checkpoint). The tokenizer lives with the data the model was
    trained on: data_dir, else where that data was then, else where the run's config says. ValueError
    with one line for what is missing or damaged."""
    from model import GPT, load_checkpoint
    from prepare import load_tokenizer
    if not os.path.exists(path):
        raise ValueError(f"no checkpoint at {path} (train first: python train.py ..., or pass --out_dir)")
    checkpoint = load_checkpoint(path, device)
    if not isinstance(checkpoint, dict) or {"model", "model_args", "config"} - checkpoint.keys():
        raise ValueError(f"{path} is not a checkpoint of train.py (it lacks its model, model_args or config)")
    model = GPT.from_checkpoint(checkpoint)
    candidates = [data_dir] if data_dir else [checkpoint.get("data_dir"), checkpoint["config"]["data_dir"]]
    found = next((d for d in candidates if d and os.path.isdir(d)), None)
    if found is None:
        raise ValueError(f"the model was trained on {candidates[-1]}, which is not here: its tokenizer is needed "
                         f"(restore it, or pass --data_dir)")
    try:
        tokenizer = load_tokenizer(found)
    except (KeyError, TypeError) as e:
        raise ValueError(f"cannot read the tokenizer in {found} ({type(e).__name__}: {e}); re-run prepare.py")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{found}'s tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{model.config.vocab_size}: it is not the data this model was trained on")
    return model, tokenizer, checkpoint


# -----------------------------------------------------------------------------
# the folders: a whole model, or a LoRA adapter in peft's layout


def write_model(model, tokenizer, checkpoint, folder, dtype):
    # merged (a LoRA run's adapters folded into the base) and cast; returns a note on the tokenizer
    import torch
    if dtype == "auto":  # the dtype the run began from, else the checkpoint's own (float32)
        dtype = folder_dtype(checkpoint.get("pretrained")) or "float32"
    model.merge_lora().to(getattr(torch, dtype))
    model.save_pretrained(folder, eos_token_id=tokenizer.eot_id)
    files, note = hf_tokenizer_files(tokenizer)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    return note


def folder_dtype(pretrained):
    try:
        with open(os.path.join(pretrained, "config.json")) as f:
            config = json.load(f)
        return config.get("torch_dtype") or config.get("dtype")
    except (TypeError, OSError, ValueError):
        return None


def write_adapter(model, checkpoint, folder):
    # peft's layout: adapter_config.json, and lora_A/lora_B of each adapted module under transformers'
    # names; our fused q/k/v and gate/up are split here, each part being its own module there
    from safetensors.torch import save_file

    from model import LORA_TARGETS
    c = model.config
    if not c.lora_rank:
        raise ValueError("--adapter exports a LoRA run's adapters, and this run trained every weight (leave it out)")
    tensors = {}
    for i, linear, _ in model.lora_projections():
        lora = getattr(linear, "lora", None)
        for part in lora.A if lora is not None else ():
            module = f"base_model.model.model.layers.{i}.{LORA_TARGETS[part]}"
            tensors[f"{module}.lora_A.weight"] = lora.A[part].detach().contiguous()
            tensors[f"{module}.lora_B.weight"] = lora.B[part].detach().contiguous()
    targets = [LORA_TARGETS[t].split(".")[-1] for t in c.lora_targets.split(",")]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": checkpoint["pretrained"],
              "r": c.lora_rank, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "inference_mode": True, "modules_to_save": None, "init_lora_weights": True}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the run's folder")
    parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint in out_dir (ckpt_best.pt: best val loss)")
    parser.add_argument("--to", required=True, help="the folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the weights' dtype; auto: that of the folder the run began from, else float32")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapter alone, in peft's layout")
    parser.add_argument("--data_dir", default=None, help="the dataset whose tokenizer to write (default: the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace --to if it holds anything")
    args = parser.parse_args(argv)
    if os.path.isdir(args.to) and os.listdir(args.to) and not args.overwrite:
        sys.exit(f"export.py: {args.to} is not empty; pass --overwrite to replace it, or choose another --to")
    # Everything is written beside the destination first and renamed into place at the end, so that a
    # failure leaves no half-written folder and an --overwrite loses nothing until the new one is whole.
    staging = args.to.rstrip("/") + ".export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        model, tokenizer, checkpoint = load_run(os.path.join(args.out_dir, args.ckpt), data_dir=args.data_dir)
        if args.adapter:
            write_adapter(model, checkpoint, staging)
            note = None
        else:
            note = write_model(model, tokenizer, checkpoint, staging, args.dtype)
    except ValueError as e:
        shutil.rmtree(staging, ignore_errors=True)
        sys.exit(f"export.py: {e}")
    if os.path.exists(args.to):
        shutil.rmtree(args.to)
    os.replace(staging, args.to)
    what = "a peft adapter" if args.adapter else "a Hugging Face model"
    print(f"wrote {what} to {args.to}" + (f" (tokenizer: {note})" if note else ""))


# -----------------------------------------------------------------------------
# the tokenizer: a prepared dataset's tokenizer -> tokenizer.json + tokenizer_config.json

# Oniguruma, the regex engine of the tokenizers library, reads two things in tiktoken's patterns
# differently from tiktoken's own engine: `X{1,3}+` is a repeat of `X{1,3}` there (possessive
# only in tiktoken), and `$` is any end of line there (the end of the text only in tiktoken).
# PATTERN_PIECE matches one atom with an optional `{n,m}+` after it, or a bare `$`.
ATOM = r"\\[pP]\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\\[\](){}|$]"
PATTERN_PIECE = re.compile(rf"({ATOM})(\{{\d+(?:,\d*)?\}}\+)?|\$")


def hf_tokenizer_files(tok):
    """prepare.Tokenizer -> ({file name: text} to write beside the model, None), or ({}, why not)
    when no tokenizer.json can encode exactly as tok.encode does."""
    if tok.kind == "char":
        return {}, ("a character vocabulary has no faithful tokenizer.json; "
                    "the rest of the folder is written without one")
    if tok.kind == "huggingface":
        from tokenizers import Tokenizer as HFTokenizer
        eos = HFTokenizer.from_str(tok.hf_json).id_to_token(tok.eot_id)
        return {"tokenizer.json": tok.hf_json, "tokenizer_config.json": tokenizer_config(eos)}, None
    ranks, pattern, specials = bpe_parts(tok)
    try:
        tokenizer_json = bytelevel_tokenizer_json(ranks, pattern, specials)
    except ValueError as e:
        return {}, (f"no faithful tokenizer.json for {tok.name} ({e}); "
                    "the rest of the folder is written without one")
    eos = next(s for s, i in specials.items() if i == tok.eot_id)
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config(eos)}, None


def tokenizer_config(eos):
    """tokenizer_config.json's text. Our encode reads a "<|endoftext|>" inside a document as plain
    text (prepare.py encodes ordinary text only), so transformers must too: split_special_tokens.
    Nothing adds a BOS, and decode must not "clean up" the spaces before punctuation."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def bpe_parts(tok):
    """A byte-level BPE's (ranks {bytes: id}, split pattern, special tokens {str: id})."""
    if tok.kind == "bpe":
        return tok.ranks, tok.pattern, {"<|endoftext|>": tok.eot_id}
    # tiktoken keeps these in private attributes, read here and nowhere else
    enc = tok.enc
    return enc._mergeable_ranks, enc._pat_str, dict(enc._special_tokens)


def bytelevel_tokenizer_json(ranks, pattern, specials):
    """tokenizer.json text of the byte-level BPE that tiktoken runs with these ranks and pattern:
    split on the pattern, each piece as bytes, merged in rank order; special tokens kept whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = byte_chars()

    def spell(token):  # bytes -> the string a byte-level tokenizer.json names the token by
        return "".join(chars[b] for b in token)

    vocab = {spell(token): i for token, i in ranks.items()}
    # tokenizers gives an added token the next free id, wrong where tiktoken's ids have holes
    # (cl100k's end-of-text is 100257, one past a gap): in the model's vocabulary it keeps its id.
    # No merge makes one, so the model never produces one from text.
    vocab.update(specials)
    if len(vocab) != len(ranks) + len(specials) or len(set(vocab.values())) != len(vocab):
        raise ValueError("a special token repeats a token or an id of the vocabulary")
    merges = [(spell(left), spell(right)) for left, right in bpe_merges(ranks)]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(onig_pattern(pattern)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return hf.to_str(pretty=True)


def byte_chars():
    """GPT-2's table of byte -> character that byte-level tokenizer.json files spell tokens in:
    the printable bytes stand for themselves, the other 68 take the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def bpe_merges(ranks):
    """The merge rules, in rank order, that rebuild tiktoken's encoding from its ranks: for each
    token of two bytes or more, the two tokens that merging its own bytes in rank order, with the
    tokens ranked below it only, leaves. tiktoken joins the adjacent pair that makes the
    lowest-ranked token, any such pair; these rules join only the pair recorded for each token, in
    the same order. The two agree where tiktoken never makes a token from another pair, which the
    tests check on real text and on every code point, for gpt2, cl100k, o200k and bpe:N."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = merge_below(ranks, token, rank)
        if len(parts) != 2:
            raise ValueError(f"token {rank} ({token!r}) cannot be made by merging two tokens below it")
        merges.append(parts)
    return merges


def merge_below(ranks, token, rank):
    """token's bytes merged as tiktoken does, lowest rank first, with tokens ranked below rank only."""
    parts = [token[i:i + 1] for i in range(len(token))]
    pairs = [ranks.get(a + b, rank) for a, b in zip(parts, parts[1:])]  # each adjacent pair's rank
    while pairs:
        best = min(pairs)
        if best >= rank:
            break
        i = pairs.index(best)  # the leftmost of the lowest, as tiktoken takes
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
        del pairs[i]
        # only the pairs beside the merged part change
        if i > 0:
            pairs[i - 1] = ranks.get(parts[i - 1] + parts[i], rank)
        if i < len(pairs):
            pairs[i] = ranks.get(parts[i] + parts[i + 1], rank)
    return parts


def onig_pattern(pattern):
    """tiktoken's split pattern, rewritten to split the same under Oniguruma: `X{n,m}+` becomes the
    atomic group `(?>X{n,m})`, `$` becomes `\\z`. (tiktoken's own patterns have `$` only in `\\s++$`,
    where the possessive `++` already makes the two readings agree.)"""
    def rewrite(m):
        if m.group(0) == "$":
            return r"\z"
        if m.group(2):
            return f"(?>{m.group(1)}{m.group(2)[:-1]})"
        return m.group(0)
    out = PATTERN_PIECE.sub(rewrite, pattern)
    if re.search(r"\)\{\d+(?:,\d*)?\}\+", out):
        raise ValueError("its split pattern repeats a group possessively, which this rewrite does not handle")
    return out


if __name__ == "__main__":
    main()
