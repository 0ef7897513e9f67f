"""
For an exported model, the tokenizer.json (and tokenizer_config.json) that encodes exactly as its dataset's did: a
Hugging Face one as it is, less any token its post-processor adds besides the BOS; a byte-level BPE (tiktoken's, bpe:N)
rebuilt as merges, which gguf_export.py writes into a GGUF file too (hf_tokenizer_files: the files to write).
"""

import json
import re

from lib.files import UserError

# Oniguruma (the tokenizers library's regex engine) reads tiktoken's `X{1,3}+` as a repeat of `X{1,3}`, not possessive,
# and `$` as any line's end, not the text's. PATTERN_PIECE: one atom with an optional `{n,m}+` after it, or a bare `$`.
ATOM = r"\\[pP]\{\w+\}|\\.|\[(?:\\.|[^\]\\])*\]|[^\\\[\](){}|$]"
PATTERN_PIECE = re.compile(rf"({ATOM})(\{{\d+(?:,\d*)?\}}\+)?|\$")
WITHOUT = "the rest of the folder is written without one"  # the end of each note on a tokenizer not written


def hf_tokenizer_files(tok):
    """Tokenizer -> ({file name: text} to write beside the model, None), or ({}, why none encodes exactly as it)."""
    if tok.kind in ("char", "nanogpt_char"):
        return {}, f"a character vocabulary has no faithful tokenizer.json; {WITHOUT}"
    if tok.kind == "huggingface":
        from tokenizers import Tokenizer as HFTokenizer
        hf = HFTokenizer.from_str(tok.hf_json)
        eos, bos = hf.id_to_token(tok.eot_id), hf.id_to_token(tok.bos_id) if tok.bos_id is not None else None
        text = tok.hf_json
        if hf.truncation or hf.padding:  # saved with them on, which prepare.py turned off (tokenizer.hf_encoder)
            text = json.dumps({**json.loads(text), "truncation": None, "padding": None}, ensure_ascii=False)

        def framed(text):  # whether it adds the BOS (if any) to a text, as prepare.py did, and no more, even to a pair
            tokenizer = HFTokenizer.from_str(text)
            plain = tokenizer.encode("a", add_special_tokens=False).ids
            pair = set(tokenizer.encode("a", "a").ids) - set(plain) - {tok.bos_id}
            return tokenizer.encode("a").ids == [tok.bos_id] * (bos is not None) + plain and not pair
        if not framed(text):  # it adds more ('<s> $A </s>'), which transformers would put in every prompt: BOS only
            whole = json.loads(text)
            text = json.dumps({**whole, "post_processor": bos_only(whole["post_processor"], bos, tok.bos_id)},
                              ensure_ascii=False)
            if not framed(text):
                return {}, f"no faithful tokenizer.json (its post-processor adds tokens after a text); {WITHOUT}"
        return {"tokenizer.json": text, "tokenizer_config.json": tokenizer_config(eos, bos)}, None
    ranks, pattern, specials = bpe_parts(tok)
    try:
        tokenizer_json = bytelevel_tokenizer_json(ranks, pattern, specials)
    except ValueError as e:
        return {}, f"no faithful tokenizer.json for {tok.name} ({e}); {WITHOUT}"
    eos = next(s for s, i in specials.items() if i == tok.eot_id)
    return {"tokenizer.json": tokenizer_json, "tokenizer_config.json": tokenizer_config(eos)}, None


def bos_only(processor, bos, bos_id):
    """processor (a tokenizer.json's post-processor) made to put the BOS bos (None: none) before a text and no other
    token: templates (Bert's and Roberta's become one) keep texts and a leading BOS; a Sequence's other steps stay."""
    kind = processor.get("type")
    if kind == "Sequence":
        return {**processor, "processors": [bos_only(p, bos, bos_id) for p in processor["processors"]]}
    if kind not in ("TemplateProcessing", "BertProcessing", "RobertaProcessing"):
        return processor  # it adds no token
    first = [{"SpecialToken": {"id": bos, "type_id": 0}}] if bos else []
    texts = [{"Sequence": {"id": name, "type_id": 0}} for name in "AB"]
    return {"type": "TemplateProcessing", "single": first + texts[:1], "pair": first + texts,
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}} if bos else {}}


def tokenizer_config(eos, bos=None):
    """tokenizer_config.json's text, matching prepare.py: "<|endoftext|>" in a document is text (split_special_tokens);
    a prompt gets the post-processor's BOS bos (None: none; llama.cpp adds one unless told not to) and no EOS;
    padding is end-of-text, as config.json says; decode keeps the spaces before punctuation (no clean-up)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,  # config.json's
              **({"bos_token": bos} if bos else {}), "add_bos_token": bos is not None, "add_eos_token": False,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    return json.dumps(config, indent=2, ensure_ascii=False) + "\n"


def bpe_parts(tok):
    """A byte-level BPE's (ranks {bytes: id}, split pattern, special tokens {str: id})."""
    if tok.kind == "bpe":
        return tok.ranks, tok.pattern, {"<|endoftext|>": tok.eot_id}
    enc = tok.enc  # tiktoken keeps these in private attributes, read here and nowhere else
    return enc._mergeable_ranks, enc._pat_str, dict(enc._special_tokens)


def bytelevel_tokenizer_json(ranks, pattern, specials):
    """tokenizer.json text of the byte-level BPE that tiktoken runs with these ranks, pattern and special tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    chars = byte_chars()

    def spell(token):  # bytes -> the string a byte-level tokenizer.json names the token by
        return "".join(chars[b] for b in token)
    vocab = {spell(token): i for token, i in ranks.items()}
    # tokenizers gives an added token the next free id, wrong where tiktoken's ids have holes (cl100k's end-of-text
    # is 100257, one past a gap): in the model's vocabulary it keeps its id; no merge makes one from text.
    vocab.update(specials)
    if len(vocab) != len(ranks) + len(specials) or len(set(vocab.values())) != len(vocab):
        raise UserError("a special token repeats a token or an id of the vocabulary")
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
    """GPT-2's table of byte -> character that byte-level tokenizer.json files spell tokens in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def bpe_merges(ranks):
    """The merge rules, in rank order, that rebuild tiktoken's encoding from its ranks: per token of two bytes or more,
    the two parts merge_below leaves. tiktoken joins any adjacent pair making the lowest-ranked token, these rules only
    the recorded one; they agree where no token comes from another pair (tested on real text, every code point)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = merge_below(ranks, token, rank)
        if len(parts) != 2:
            raise UserError(f"token {rank} ({token!r}) cannot be made by merging two tokens below it")
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
        del pairs[i]  # only the pairs beside the merged part change
        if i > 0:
            pairs[i - 1] = ranks.get(parts[i - 1] + parts[i], rank)
        if i < len(pairs):
            pairs[i] = ranks.get(parts[i] + parts[i + 1], rank)
    return parts


def onig_pattern(pattern):
    """tiktoken's split pattern, rewritten to split the same under Oniguruma: `X{n,m}+` as `(?>X{n,m})`,
    `$` as `\\z` (tiktoken's own patterns have `$` only in `\\s++$`, where the `++` makes the two agree)."""
    def rewrite(m):
        if m.group(0) == "$":
            return r"\z"
        return f"(?>{m.group(1)}{m.group(2)[:-1]})" if m.group(2) else m.group(0)
    out = PATTERN_PIECE.sub(rewrite, pattern)
    if re.search(r"\)\{\d+(?:,\d*)?\}\+", out):
        raise UserError("its split pattern repeats a group possessively, which this rewrite does not handle")
    return out
