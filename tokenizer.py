"""
Tokenizers, for every kind prepare.py makes: tiktoken's encodings (gpt2, cl100k_base, o200k_base, ...),
char (a corpus's characters), bpe:N (a byte-level BPE trained here with rustbpe), a Hugging Face
tokenizer.json, and nanoGPT's character datasets (meta.pkl). One Tokenizer object with encode,
decode, vocab_size and eot_id, whatever the kind; the dataset folder says which (read_meta); and
the tokenizer.json that encodes the same way, for an exported model (hf_tokenizer_files).

    from tokenizer import load_tokenizer, read_meta
    meta = read_meta("data/stdlib")  # {"dtype": "uint16", "vocab_size": 4097, "eot_id": 4096, ...}
    tokenizer = load_tokenizer("data/stdlib")
    print(tokenizer.decode(tokenizer.encode("import os")))
"""

import base64
import json
import os
import pickle
import re
import sys
from itertools import chain
from pathlib import Path

import numpy as np

from bounds import confined
from errors import UserError

# The end-of-text tokens of Hugging Face tokenizers, in order of preference.
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")
MARKER = "prepare.incomplete"  # in a dataset's folder only while prepare.py renames its outputs into place


def die(msg):
    """A user's mistake: one line naming the problem and the fix, non-zero exit; labelled with the running
    script's name (sample.py reads tokenizers too), prepare.py's where it is none of ours (a test)."""
    main = os.path.abspath(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    ours = os.path.dirname(main) == os.path.dirname(os.path.abspath(__file__))
    raise SystemExit(f"{os.path.basename(main) if ours else 'prepare.py'}: {msg}")


def durable_replace(src, dst):
    """Rename src to dst (a file or a folder, replacing a file) and make the rename itself survive a power cut:
    the folder that holds the name is synced too. Every finished output (datasets, checkpoints, exports)
    takes its name this way, after its bytes have reached the disk."""
    os.replace(src, dst)
    try:
        folder = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    except OSError:  # a platform that cannot open folders (Windows): the rename is all there is
        return
    try:
        os.fsync(folder)
    finally:
        os.close(folder)

# -----------------------------------------------------------------------------
# tokenizers: one object for every kind, made by the small constructors below it

class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, vocab_size and eot_id, whatever the kind.
    Exactly one of enc (tiktoken's, for tiktoken and bpe), chars and hf does the encoding."""

    def __init__(self, kind, name, vocab_size, eot_id, enc=None, chars=None, hf=None,
                 hf_json=None, ranks=None, pattern=None):
        self.kind, self.name = kind, name  # kind: tiktoken | bpe | char | nanogpt_char | huggingface
        self.vocab_size, self.eot_id = vocab_size, eot_id  # eot_id None: nanoGPT's characters have none
        self.enc, self.chars, self.hf = enc, chars, hf
        self.hf_json, self.ranks, self.pattern = hf_json, ranks, pattern  # what save() writes
        if chars is not None:  # np.searchsorted needs the code points sorted; ids keep the given order
            codes = np.array([ord(c) for c in chars], dtype=np.uint32)
            self.code_ids = np.argsort(codes, kind="stable").astype(np.uint32)
            self.codes = codes[self.code_ids]

    def encode(self, text):
        """str -> list[int], without end-of-text."""
        return self.encode_docs([text], [False])[0].tolist()

    def decode(self, ids):
        """list[int] -> str; end-of-text decodes to <|endoftext|> (or the tokenizer's own)."""
        ids = [int(i) for i in ids]
        if self.enc is not None:
            return self.enc.decode(ids)
        if self.chars is not None:  # an id past the characters is our end-of-text; nanoGPT's have none
            beyond = "<|endoftext|>" if self.eot_id is not None else "\ufffd"
            return "".join(self.chars[i] if i < len(self.chars) else beyond for i in ids)
        return self.hf.decode(ids, skip_special_tokens=False)

    def encode_docs(self, texts, ends):
        """list[str] -> list of uint32 arrays, each text's ids, then end-of-text where ends[i] (a
        document's last piece). Thread-safe; the tiktoken and HF encoders release the GIL, so
        threads encode in parallel."""
        if self.enc is not None:  # encode_to_numpy with nothing special is encode_ordinary, minus the list
            out = [self.enc.encode_to_numpy(text, disallowed_special=()) for text in texts]
        elif self.chars is not None:
            out = [self.encode_chars(text) for text in texts]
        else:
            encodings = self.hf.encode_batch(texts, add_special_tokens=False)
            out = [np.array(encoding.ids, dtype=np.uint32) for encoding in encodings]
        if not any(ends):
            return out
        if self.eot_id is None:
            raise UserError(f"tokenizer {self.name} has no end-of-text token to end documents with")
        eot = np.array([self.eot_id], dtype=np.uint32)
        return [np.concatenate([ids, eot]) if end else ids for ids, end in zip(out, ends)]

    def special_tokens(self):
        """{text: id} of the tokens a chat template writes as markers (<|im_end|>, <|endoftext|>, ...)."""
        if self.enc is not None:
            return {token: self.enc.encode_single_token(token) for token in self.enc.special_tokens_set}
        if self.hf is not None:
            added = json.loads(self.hf_json).get("added_tokens", [])
            return {t["content"]: t["id"] for t in added if t.get("special")}
        return {}

    def encode_chat(self, text, spans):
        """A chat template's text -> (ids, mask): its markers read as special tokens, and mask 1 for each token
        that overlaps a trained span of characters [(start, end)], 0 elsewhere. Both uint8/uint32 arrays."""
        if self.enc is not None:
            ids = self.enc.encode(text, allowed_special="all")
            starts = self.enc.decode_with_offsets(ids)[1]
        elif self.hf is not None:
            if getattr(self, "hf_chat", None) is None:  # a second encoder that reads "<|im_end|>" as the token
                from tokenizers import Tokenizer as HFTokenizer
                self.hf_chat = HFTokenizer.from_str(self.hf_json)
            encoding = self.hf_chat.encode(text, add_special_tokens=False)
            ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
        else:
            raise UserError(f"a {self.kind} tokenizer has no special tokens for a chat template: use bpe:N, "
                             f"a tiktoken encoding or a model's tokenizer.json")
        starts = np.array(starts, dtype=np.int64)
        ends = np.append(starts[1:], len(text))
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:  # a token overlapping the span is trained: " Hello" whose space is outside it
            mask[(starts < end) & (ends > start)] = 1
        return np.array(ids, dtype=np.uint32), mask

    def encode_chars(self, text):
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        at = np.searchsorted(self.codes, code_points)
        unknown = self.codes[np.minimum(at, len(self.codes) - 1)] != code_points
        if unknown.any():
            raise UserError(f"character {chr(code_points[unknown.argmax()])!r} is not in the vocabulary")
        return self.code_ids[at]

    def save(self, out_dir):
        """Write what load_tokenizer needs into out_dir (under a .tmp name) -> (meta's entry, file name)."""
        if self.kind == "tiktoken":
            return {"kind": "tiktoken", "name": self.name}, None
        if self.kind == "huggingface":
            name, data = "tokenizer.json", self.hf_json
        elif self.kind == "char":
            name, data = "vocab.json", json.dumps({"kind": "char", "chars": self.chars})
        elif self.kind == "bpe":  # the ranks in order; byte-level, so each token is a base64 byte string
            tokens = sorted(self.ranks, key=self.ranks.get)
            ranks = [base64.b64encode(token).decode() for token in tokens]
            name, data = "vocab.json", json.dumps({"kind": "bpe", "pattern": self.pattern, "ranks": ranks})
        else:  # nanoGPT's characters have no end-of-text, so no dataset of ours is made with them
            raise UserError(f"a {self.kind} tokenizer is not saved with a dataset")
        (Path(out_dir) / (name + ".tmp")).write_text(data, encoding="utf-8")
        return {"kind": self.kind, "name": self.name, "file": name}, name


def tiktoken_tokenizer(name):
    import tiktoken
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # it downloads on first use
        die(f"cannot load tiktoken encoding '{name}' ({type(e).__name__}); it downloads on first use: "
            f"go online once or set TIKTOKEN_CACHE_DIR to a folder holding it")
    return Tokenizer("tiktoken", name, enc.n_vocab, enc.eot_token, enc=enc)


def bpe_tokenizer(name, ranks, pattern):
    """Our byte-level BPE (rustbpe's ranks), run by tiktoken, with <|endoftext|> after the ranks."""
    import tiktoken
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    return Tokenizer("bpe", name, enc.n_vocab, enc.eot_token, enc=enc, ranks=ranks, pattern=pattern)


def char_tokenizer(chars, kind="char"):
    """chars in id order. Ours (char) ends documents with one more id; nanoGPT's (nanogpt_char) has none."""
    eot_id = len(chars) if kind == "char" else None
    return Tokenizer(kind, kind, len(chars) + (eot_id is not None), eot_id, chars=chars)


def hf_tokenizer(name, hf_json):
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        die("a tokenizer.json needs the tokenizers library (pip install tokenizers)")
    hf = HFTokenizer.from_str(hf_json)
    hf.encode_special_tokens = True  # a literal "</s>" in a document is text, not a token
    vocab = hf.get_vocab(with_added_tokens=True)
    eot_id = next((vocab[t] for t in EOT_NAMES if t in vocab), None)
    if eot_id is None:
        die(f"tokenizer {name} has none of the end-of-text tokens {', '.join(EOT_NAMES)} (add one to it)")
    return Tokenizer("huggingface", name, max(vocab.values()) + 1, eot_id, hf=hf, hf_json=hf_json)


def wordpiece_tokenizer(name, size, texts):
    """A WordPiece vocabulary of size tokens learned from texts() with the tokenizers library, as BERT's: text
    split at whitespace and punctuation (case kept), words into pieces marked ##; decoding joins the words with
    single spaces. Saved as its tokenizer.json, a Hugging Face tokenizer from then on."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        die("wordpiece:N needs the tokenizers library (pip install tokenizers)")
    learner = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    learner.normalizer = normalizers.BertNormalizer(lowercase=False)
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    learner.decoder = decoders.WordPiece()
    learner.train_from_iterator(texts(), trainers.WordPieceTrainer(vocab_size=size,
                                                                   special_tokens=["[UNK]", "<|endoftext|>"]))
    return hf_tokenizer(name, learner.to_str())


def make_tokenizer(spec, texts):
    """--tokenizer -> Tokenizer; texts() streams the corpus for the kinds that learn a vocabulary."""
    if spec == "char":
        chars = set()
        for text in texts():
            chars.update(text)
        return char_tokenizer("".join(sorted(chars)))
    if spec.startswith("bpe:"):
        size = spec[4:]
        if not size.isdigit() or int(size) < 256:
            die(f"bad tokenizer '{spec}' (bpe:N needs a whole number N >= 256, e.g. bpe:4096)")
        import rustbpe
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(texts(), int(size))
        ranks = {bytes(b): rank for b, rank in trainer.get_mergeable_ranks()}
        return bpe_tokenizer(spec, ranks, trainer.get_pattern())
    if spec.startswith("wordpiece:"):
        size = spec[10:]
        if not size.isdigit() or int(size) < 100:
            die(f"bad tokenizer '{spec}' (wordpiece:N needs a whole number N >= 100, e.g. wordpiece:8192)")
        return wordpiece_tokenizer(spec, int(size), texts)
    import tiktoken
    if spec in tiktoken.list_encoding_names():
        return tiktoken_tokenizer(spec)
    path = Path(spec)
    if path.is_dir() and (path / "meta.json").exists():  # a prepared dataset: reuse its tokenizer
        try:
            return load_tokenizer(path)
        except ValueError as e:
            die(str(e))
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            return hf_tokenizer(str(path), path.read_text(encoding="utf-8"))
        except SystemExit:
            raise
        except Exception as e:
            die(f"cannot load {path} as a Hugging Face tokenizer.json ({type(e).__name__}: {str(e)[:80]})")
    if path.exists() or "/" in spec or spec.endswith(".json"):
        die(f"no tokenizer.json at {spec} (check the path)")
    die(f"unknown tokenizer '{spec}' (use char, bpe:N, a path to a tokenizer.json, "
        f"or one of {', '.join(tiktoken.list_encoding_names())})")

# -----------------------------------------------------------------------------
# reading a dataset back: what its folder says about itself (read_meta), and its tokenizer

def refuse_unfinished(data_dir):
    if (Path(data_dir) / MARKER).exists():
        raise UserError(f"{data_dir} is a dataset prepare.py did not finish (re-run prepare.py)")


def read_meta(data_dir):
    """What a data folder says about itself: its meta.json, with dtype as numpy's name and vocab_size an
    int (ours also hold eot_id, the tokenizer and counts); else, from nanoGPT's meta.pkl (a character
    vocabulary), {dtype, vocab_size, eot_id: None, tokenizer}; else nanoGPT's default, GPT-2 tokens.
    Every problem is a ValueError of one line."""
    refuse_unfinished(data_dir)
    path = Path(data_dir) / "meta.json"
    if path.exists():
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            meta["dtype"] = np.dtype(meta["dtype"]).name
            vocab_size, eot_id = meta["vocab_size"], meta.get("eot_id")
            if meta["dtype"] not in ("uint16", "uint32"):  # uint8 over a uint16 file reads each id as two
                raise UserError(f"dtype {meta['dtype']} is not uint16 or uint32, what token files hold")
            if type(vocab_size) is not int or vocab_size < 1:
                raise UserError(f"vocab_size {vocab_size!r} is not a whole number above 0")
            if meta["dtype"] == "uint16" and vocab_size > 1 << 16:
                raise UserError(f"dtype uint16 cannot hold the ids of a vocab_size of {vocab_size}")
            if eot_id is not None and (type(eot_id) is not int or not 0 <= eot_id < vocab_size):
                raise UserError(f"eot_id {eot_id!r} is not a token id below vocab_size {vocab_size}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
            raise UserError(f"{path} is damaged ({why}); re-run prepare.py to write it again") from None
        return meta
    if (Path(data_dir) / "meta.pkl").exists():
        chars = nanogpt_chars(Path(data_dir) / "meta.pkl")
        return {"dtype": "uint16", "vocab_size": len(chars), "eot_id": None,
                "tokenizer": {"kind": "nanogpt_char", "file": "meta.pkl"}}
    return {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
            "tokenizer": {"kind": "tiktoken", "name": "gpt2"}}


def load_tokenizer(data_dir):
    """The tokenizer a dataset was made with: meta.json's, nanoGPT's meta.pkl's characters, or GPT-2 with
    neither (nanoGPT's convention). An unfinished dataset is a ValueError, as in read_meta."""
    refuse_unfinished(data_dir)
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").exists():
        if (data_dir / "meta.pkl").exists():
            return char_tokenizer("".join(nanogpt_chars(data_dir / "meta.pkl")), kind="nanogpt_char")
        return tiktoken_tokenizer("gpt2")
    spec = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))["tokenizer"]
    if spec["kind"] == "tiktoken":
        return tiktoken_tokenizer(spec["name"])
    path = confined(data_dir, spec.get("file"), data_dir / "meta.json")  # no /dev/zero, no ../elsewhere
    if not path.exists():
        die(f"{path} is missing, and meta.json needs it (re-run prepare.py)")
    try:
        return tokenizer_from_file(spec, path.read_text(encoding="utf-8"))
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # a pattern the regex engine refuses; the Rust libraries' panics are BaseExceptions
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(f"cannot read the tokenizer in {path} ({type(e).__name__}: {why}): re-run prepare.py") \
            from None


def tokenizer_from_file(spec, data):
    # meta.json's tokenizer spec and the text of the file it names -> Tokenizer
    if spec["kind"] == "huggingface":
        return hf_tokenizer(spec["name"], data)
    data = json.loads(data)
    if spec["kind"] == "char":
        return char_tokenizer(data["chars"])
    ranks = {base64.b64decode(token): rank for rank, token in enumerate(data["ranks"])}
    return bpe_tokenizer(spec["name"], ranks, data["pattern"])


class NotPlain(pickle.UnpicklingError):
    """A pickle names a class or a function: what it would call to build its objects."""


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain values only. A pickle runs code only by calling the classes and functions it names,
    and every name goes through find_class, which refuses them all."""

    def find_class(self, module, name):
        raise NotPlain(f"{module}.{name}")


def read_plain_pickle(path):
    """The value pickled in path if it holds only dicts, lists, tuples, strings, numbers, booleans and None;
    else a ValueError of one line. Nothing in the file is ever run."""
    def refused(what):
        return ValueError(f"{path} holds objects other than plain values ({what}) and is not loaded; "
                          f"nanoGPT's meta.pkl holds only dicts, strings and integers")

    try:
        with open(path, "rb") as f:
            value = PlainUnpickler(f).load()
    except NotPlain as e:
        raise refused(e) from None
    except Exception as e:  # a damaged pickle fails in many ways
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}: {e})") from None
    seen, todo = set(), [value]
    while todo:  # a loop, not recursion: the nesting may be deep, and a list may hold itself
        item = todo.pop()
        if type(item) not in (dict, list, tuple, str, int, float, bool, type(None)):
            raise refused(f"a {type(item).__name__}")
        if isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend(chain(item.keys(), item.values()) if isinstance(item, dict) else item)
    return value


def nanogpt_chars(path):
    """The characters of nanoGPT's meta.pkl, in id order: {'vocab_size': n, 'itos': {id: char},
    'stoi': {char: id}} for the ids 0..n-1, as its data/shakespeare_char/prepare.py writes it."""
    meta = read_plain_pickle(path)
    itos = meta.get("itos") if isinstance(meta, dict) else None
    chars = [itos.get(i) for i in range(len(itos))] if isinstance(itos, dict) else []
    characters = chars and all(isinstance(c, str) and len(c) == 1 for c in chars)
    stoi = {c: i for i, c in enumerate(chars)} if characters else None  # also what makes them distinct
    if not (characters and meta.get("stoi") == stoi and len(stoi) == meta.get("vocab_size") == len(chars)):
        raise UserError(f"{path} is not nanoGPT's meta.pkl of a character dataset (it needs vocab_size, "
                         f"and itos and stoi between the ids 0..vocab_size-1 and single characters)")
    return chars


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
    if tok.kind in ("char", "nanogpt_char"):
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
    prepare.py puts nothing before a document and ends it with the end-of-text id itself, so no
    runtime may add a BOS or an EOS to a prompt (llama.cpp adds a BOS unless told not to); and
    decode must not "clean up" the spaces before punctuation."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "add_bos_token": False,
              "add_eos_token": False, "split_special_tokens": True, "clean_up_tokenization_spaces": False}
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
        raise UserError("its split pattern repeats a group possessively, which this rewrite does not handle")
    return out


def check_tokenizer(data_dir, meta, folder, model_vocab, fix=None):
    """ValueError, in one line with the fix, unless the dataset data_dir (meta: its read_meta) was made with
    the tokenizer of folder: a Hugging Face model folder, whose config.json says model_vocab, or a dataset (the
    one a run was trained on). The same tokenizer gives a document's ids back from its text: the first few are
    decoded and encoded again."""
    fix = fix or (f"prepare it with the model's tokenizer: python prepare.py CORPUS --tokenizer={folder} "
                  f"--out_dir=DIR")
    if meta["vocab_size"] > model_vocab:
        raise UserError(f"{data_dir} has {meta['vocab_size']} token ids, more than the {model_vocab} of {folder}: "
                         f"{fix}")
    dataset = any(os.path.exists(os.path.join(folder, name)) for name in ("meta.json", "meta.pkl", "val.bin"))
    if not dataset and not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return  # nothing to compare with
    ids = np.array(np.memmap(os.path.join(data_dir, "val.bin"), dtype=np.dtype(meta["dtype"]), mode="r")[:4096],
                   dtype=np.int64)
    ends = np.flatnonzero(ids == meta["eot_id"]) if meta.get("eot_id") is not None else np.array([], dtype=int)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(int)
    documents = [ids[a:b].tolist() for a, b in zip(starts, ends)][:8]  # whole ones, without end-of-text
    try:
        ours = load_tokenizer(data_dir)
        theirs = load_tokenizer(folder) if dataset else make_tokenizer(folder, None)
    except (ValueError, KeyError, TypeError, SystemExit) as e:
        raise UserError(f"cannot read the tokenizer of {data_dir} to check it against {folder}'s "
                         f"({type(e).__name__}: {e}): {fix}") from None
    # conversations' markers (<|im_start|>, ...) are special tokens: their text reads as those
    encode = (lambda text: theirs.encode_chat(text, [])[0].tolist()) if meta.get("masks") else theirs.encode
    for doc in documents or [ids[:512].tolist()]:
        try:
            again = encode(ours.decode(doc))
        except ValueError:  # a character the other vocabulary lacks, special tokens it has not
            again = None
        compared = len(doc) if documents else len(doc) - 64  # a cut document's last word may split otherwise
        if again is None or again[:compared] != doc[:compared]:
            raise UserError(f"{data_dir} was not prepared with the tokenizer of {folder}: {fix}")


def check_token_files(data_dir, meta, block_size):
    """The training split's length in tokens, once train.bin and val.bin are there, whole tokens of meta's
    dtype, as many as meta counted (prepare.py's meta.json does), longer than block_size, with a mask of as
    many bytes where meta says there are masks; else ValueError in one line with the fix."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path):
            raise UserError(f"no {path}: prepare the data first (python prepare.py --out_dir={data_dir} ...)")
        size = os.path.getsize(path)
        if size == 0:
            raise UserError(f"{path} is empty: prepare the data with --val_fraction above 0 or --val_input")
        if size % itemsize:
            raise UserError(f"{path} has {size} bytes, not a whole number of {meta['dtype']} tokens: it is corrupt "
                             f"or meta.json's dtype is wrong (re-run prepare.py)")
        counted = meta[split].get("tokens") if isinstance(meta.get(split), dict) else None
        if isinstance(counted, int) and size // itemsize != counted:
            raise UserError(f"{path} holds {size // itemsize:,} {meta['dtype']} tokens where meta.json says "
                             f"{counted:,}: they are not from one prepare.py run (re-run prepare.py)")
        if size // itemsize <= block_size:
            raise UserError(f"{path} has {size // itemsize} tokens, too few for block_size={block_size} "
                             f"(lower block_size or prepare more data)")
        mask = os.path.join(data_dir, f"{split}.mask.bin")
        if meta.get("masks") and (not os.path.exists(mask) or os.path.getsize(mask) != size // itemsize):
            raise UserError(f"{mask} is missing or does not hold one byte per token of {path} (re-run prepare.py)")
    return os.path.getsize(os.path.join(data_dir, "train.bin")) // itemsize
