"""
Prepare a text corpus for training: files and folders in, DIR/train.bin, DIR/val.bin and
DIR/meta.json out (flat token ids, nanoGPT's format, each document followed by end-of-text).

    python prepare.py --tokenizer=bpe:4096          # default corpus: this Python's stdlib -> data/stdlib
    python prepare.py input.txt --tokenizer=char --out_dir=data/shakespeare_char
    python prepare.py notes/ docs.jsonl.gz --out_dir=data/mine          # GPT-2 tokens, 10% of documents to val
    python prepare.py train.parquet --val_input=val.parquet --tokenizer=path/to/tokenizer.json --out_dir=data/ft
    python prepare.py notes/ --analyze              # what would be read, skipped, and how long documents are
    python prepare.py --bench                       # our throughput against tiktoken's own batch encoder

Inputs: folders are read recursively in sorted order, hidden files and folders left out.
.jsonl/.ndjson: one document per line, from the field text, content or body (or --field);
.json: one such object or an array of them; .parquet: the same column, in record batches;
anything else is one plain UTF-8 document per file; any of these may be gzipped (.gz).
Nothing is held whole: documents stream through, and a big plain-text file is read and encoded
in ~64 KB pieces, cut only where the tokens cannot change (SAFE_CUT), so memory stays flat for a
10 GB .txt too. Held whole: one .json file (use .jsonl for big ones), one JSON line or parquet
row, a stretch of text with no SAFE_CUT in it, and a plain-text file when the tokenizer is a
tokenizer.json (its pre-tokenizer could be anything, so it gets the whole document).
Files that are not UTF-8 text and bad records are skipped and listed, never lost silently.

Tokenizers: a tiktoken name (gpt2, cl100k_base, o200k_base, ...), char (the corpus's
characters), bpe:N (a byte-level BPE of N tokens trained here with rustbpe), a Hugging Face
tokenizer.json (or a folder holding one), or a prepared dataset folder (reuse its tokenizer).
Read one back with:  from prepare import load_tokenizer; tok = load_tokenizer("data/stdlib")
"""

import argparse
import base64
import codecs
import errno
import gzip
import hashlib
import json
import os
import re
import stat
import sys
import sysconfig
import tempfile
import time
import zlib
from collections import deque, namedtuple
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

FORMAT_VERSION = 1
TEXT_FIELDS = ("text", "content", "body")
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # HF tokenizers, in order of preference
BATCH_CHARS = 1 << 16  # documents are grouped into ~64 KB batches for the encoder threads
MAX_EXAMPLES = 100  # bad records listed in meta.json (all are counted)
PIECE = 1 << 16  # plain-text files are read, checked and encoded ~64 KB at a time
# Where a text can be cut and its pieces encoded apart with the same tokens as the whole, for the
# regex pre-tokenizers of GPT-2, cl100k, o200k and rustbpe (tests/test_prepare.py checks it): before
# a space or newline between two letters or digits, or after a newline between a non-space and a
# letter or digit. (After any newline is not enough: "Z\n\n|X" and " \n|X" change GPT-2's tokens.)
SAFE_CUT = re.compile(r"(?<=[^\W_])(?=[ \n][^\W_])|(?<=\S\n)(?=[^\W_])")
LAST_CUT = re.compile(r"(?s:.*)(?:" + SAFE_CUT.pattern + ")")  # .* backtracks from the end: the last one
SAFE_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base")  # and bpe:N
MARKER = "prepare.incomplete"  # in DIR only while a run renames its outputs into place


def die(msg):
    """A user's mistake: one line naming the problem and the fix, non-zero exit."""
    raise SystemExit(f"prepare.py: {msg}")

# -----------------------------------------------------------------------------
# tokenizers: one object for every kind, with encode, decode, vocab_size and eot_id

class Tokenizer:
    """encode(str) -> list[int], decode(list[int]) -> str, vocab_size, eot_id, whatever the kind."""

    def __init__(self, kind, name, enc=None, chars=None, hf_json=None, ranks=None, pattern=None):
        self.kind, self.name = kind, name  # kind: tiktoken | char | bpe | huggingface
        self.enc, self.chars, self.hf_json = enc, chars, hf_json
        self.ranks, self.pattern = ranks, pattern  # bpe: what tiktoken.Encoding was made from
        if enc is not None:  # tiktoken, named or our own bpe ranks
            self.vocab_size, self.eot_id = enc.n_vocab, enc.eot_token
        elif chars is not None:
            self.eot_id, self.vocab_size = len(chars), len(chars) + 1
            self.codes = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted: chars are
        else:
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                die("a tokenizer.json needs the tokenizers library (pip install tokenizers)")
            self.hf = HFTokenizer.from_str(hf_json)
            self.hf.encode_special_tokens = True  # a literal "</s>" in a document is text, not a token
            vocab = self.hf.get_vocab(with_added_tokens=True)
            self.vocab_size = max(vocab.values()) + 1
            self.eot_id = next((vocab[t] for t in EOT_NAMES if t in vocab), None)
            if self.eot_id is None:
                die(f"tokenizer {name} has none of the end-of-text tokens {', '.join(EOT_NAMES)} (add one to it)")

    def encode(self, text):
        """str -> list[int], without end-of-text."""
        if self.enc is not None:
            return self.enc.encode_ordinary(text)
        if self.chars is not None:
            return self.encode_docs([text], [False])[0].tolist()
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        """list[int] -> str; end-of-text decodes to <|endoftext|> (or the tokenizer's own)."""
        ids = [int(i) for i in ids]
        if self.enc is not None:
            return self.enc.decode(ids)
        if self.chars is not None:
            return "".join(self.chars[i] if i < len(self.chars) else "<|endoftext|>" for i in ids)
        return self.hf.decode(ids, skip_special_tokens=False)

    def encode_docs(self, texts, ends):
        """list[str] -> list of uint32 arrays, each text's ids, then end-of-text where ends[i] (a
        document's last piece). Thread-safe; the tiktoken and HF encoders release the GIL, so
        threads encode in parallel."""
        eot = np.array([self.eot_id], dtype=np.uint32)
        if self.enc is not None:  # encode_to_numpy with nothing special = encode_ordinary, minus the list
            out = [self.enc.encode_to_numpy(t, disallowed_special=()) for t in texts]
        elif self.chars is not None:
            out = []
            for t in texts:
                cps = np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32)
                ids = np.searchsorted(self.codes, cps).astype(np.uint32)
                unknown = self.codes[np.minimum(ids, len(self.codes) - 1)] != cps
                if unknown.any():
                    raise ValueError(f"character {chr(cps[unknown.argmax()])!r} is not in the vocabulary")
                out.append(ids)
        else:
            out = [np.array(e.ids, dtype=np.uint32) for e in self.hf.encode_batch(texts, add_special_tokens=False)]
        return [np.concatenate([ids, eot]) if end else ids for ids, end in zip(out, ends)]

    def save(self, out_dir):
        """Write what load_tokenizer needs into out_dir (under a .tmp name); return meta's entry."""
        if self.kind == "tiktoken":
            return {"kind": "tiktoken", "name": self.name}, None
        if self.kind == "huggingface":
            name, data = "tokenizer.json", self.hf_json
        else:
            name = "vocab.json"
            if self.kind == "char":
                data = json.dumps({"kind": "char", "chars": self.chars})
            else:  # ranks in order: byte-level, so each token is a base64 byte string
                ranks = sorted(self.ranks.items(), key=lambda kv: kv[1])
                data = json.dumps({"kind": "bpe", "pattern": self.pattern,
                                   "ranks": [base64.b64encode(b).decode() for b, _ in ranks]})
        (Path(out_dir) / (name + ".tmp")).write_text(data, encoding="utf-8")
        return {"kind": self.kind, "name": self.name, "file": name}, name


def bpe_from_ranks(name, ranks, pattern):
    import tiktoken
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})
    return Tokenizer("bpe", name, enc=enc, ranks=ranks, pattern=pattern)


def tiktoken_tokenizer(name):
    import tiktoken
    try:
        return Tokenizer("tiktoken", name, enc=tiktoken.get_encoding(name))
    except Exception as e:  # it downloads on first use
        die(f"cannot load tiktoken encoding '{name}' ({type(e).__name__}); it downloads on first use: "
            f"go online once or set TIKTOKEN_CACHE_DIR to a folder holding it")


def load_tokenizer(data_dir):
    """The tokenizer a prepared dataset was made with; GPT-2 when data_dir has no meta.json (nanoGPT's)."""
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").exists():
        return tiktoken_tokenizer("gpt2")
    spec = json.loads((data_dir / "meta.json").read_text())["tokenizer"]
    if spec["kind"] == "tiktoken":
        return tiktoken_tokenizer(spec["name"])
    if not (data_dir / spec["file"]).exists():
        die(f"{data_dir / spec['file']} is missing, and meta.json needs it (re-run prepare.py)")
    data = (data_dir / spec["file"]).read_text(encoding="utf-8")
    if spec["kind"] == "huggingface":
        return Tokenizer("huggingface", spec["name"], hf_json=data)
    data = json.loads(data)
    if spec["kind"] == "char":
        return Tokenizer("char", "char", chars=data["chars"])
    ranks = {base64.b64decode(b): i for i, b in enumerate(data["ranks"])}
    return bpe_from_ranks(spec["name"], ranks, data["pattern"])


def make_tokenizer(spec, texts):
    """--tokenizer -> Tokenizer; texts() streams the corpus for the kinds that learn a vocabulary."""
    if spec == "char":
        chars = set()
        for t in texts():
            chars.update(t)
        return Tokenizer("char", "char", chars="".join(sorted(chars)))
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not n.isdigit() or int(n) < 256:
            die(f"bad tokenizer '{spec}' (bpe:N needs a whole number N >= 256, e.g. bpe:4096)")
        import rustbpe
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(texts(), int(n))
        ranks = {bytes(b): r for b, r in trainer.get_mergeable_ranks()}
        return bpe_from_ranks(spec, ranks, trainer.get_pattern())
    import tiktoken
    if spec in tiktoken.list_encoding_names():
        return tiktoken_tokenizer(spec)
    path = Path(spec)
    if path.is_dir() and (path / "meta.json").exists():  # a prepared dataset: reuse its tokenizer
        return load_tokenizer(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            data = path.read_text(encoding="utf-8")
            return Tokenizer("huggingface", str(path), hf_json=data)
        except SystemExit:
            raise
        except Exception as e:
            die(f"cannot load {path} as a Hugging Face tokenizer.json ({type(e).__name__}: {str(e)[:80]})")
    if path.exists() or "/" in spec or spec.endswith(".json"):
        die(f"no tokenizer.json at {spec} (check the path)")
    die(f"unknown tokenizer '{spec}' (use char, bpe:N, a path to a tokenizer.json, "
        f"or one of {', '.join(tiktoken.list_encoding_names())})")

# -----------------------------------------------------------------------------
# reading: files and folders -> documents, with everything skipped counted and listed

class SkipFile(Exception):
    """A file that cannot be read as documents; its message is the reason."""


BigText = namedtuple("BigText", "path nchars blank digest")  # a checked plain-text file too big to hold


def input_files(root, stats, only_py=False, exclude=None):
    """Yield (path, path relative to root) for every file under root, in sorted order."""
    root = Path(root)
    if not root.is_dir():
        yield root, root.name
        return

    def walk(folder, rel):
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            stats["skipped"].append((str(folder), f"unreadable folder: {e.strerror}"))
            return
        for e in entries:
            path, r = Path(e.path), f"{rel}{e.name}"
            if e.name.startswith("."):
                stats["hidden"] += 1  # .git, .venv, .DS_Store: counted, not listed
                continue
            if e.is_symlink():
                try:
                    if stat.S_ISDIR(os.stat(path).st_mode):
                        stats["skipped"].append((str(path), "symlink to a folder, not followed (pass it as an INPUT)"))
                        continue
                except OSError as err:
                    stats["skipped"].append((str(path), "symlink loop" if err.errno == errno.ELOOP else "broken symlink"))
                    continue
            if e.is_dir(follow_symlinks=False):
                if (only_py and e.name == "site-packages") or (exclude and path.resolve() == exclude):
                    continue  # installed packages aren't the stdlib; never read our own output
                yield from walk(path, r + "/")
            elif only_py and not e.name.endswith(".py"):
                continue
            else:
                yield path, r
    yield from walk(root, "")


def file_ext(path):
    """'.jsonl.gz' -> '.jsonl.gz', 'README' -> '' (for the per-extension report)."""
    name = path.name.lower()
    gz = name.endswith(".gz")
    return Path(name[:-3] if gz else name).suffix + (".gz" if gz else "")


def record_text(obj, field):
    """(text, None) from a JSON record, or (None, why not)."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object ({type(obj).__name__})"
    names = [field] if field else TEXT_FIELDS
    for name in names:
        if name in obj:
            v = obj[name]
            if not isinstance(v, str):
                return None, f"field '{name}' is not a string ({type(v).__name__})"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:  # from a JSON \ud800 escape
                return None, "invalid unicode (lone surrogate)"
            return v, None
    return None, f"no text field ({'/'.join(names)})"


def read_documents(path, field, dedup):
    """Yield (position, text or BigText, None) per document, or (position, None, why) per bad record.
    Raises SkipFile for a file that cannot be read at all."""
    ext = file_ext(path)
    if not path.is_file():
        raise SkipFile("not a regular file")
    opener = gzip.open if ext.endswith(".gz") else open
    ext = ext.removesuffix(".gz")
    if ext in (".jsonl", ".ndjson"):
        with opener(path, "rb") as f:
            for n, line in enumerate(f, 1):  # bytes: split on \n only, like JSON Lines says
                if n == 1:
                    line = line.removeprefix(codecs.BOM_UTF8)
                if not line.strip():
                    continue
                try:
                    text, why = record_text(json.loads(line), field)
                except UnicodeDecodeError:
                    text, why = None, "not UTF-8"
                except ValueError as e:
                    text, why = None, f"malformed JSON ({getattr(e, 'msg', e)})"
                yield str(n), text, why
    elif ext == ".parquet":
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise SkipFile("needs pyarrow (pip install pyarrow)")
        try:
            pf = pq.ParquetFile(path)
        except pa.ArrowException as e:
            raise SkipFile(f"not a readable parquet file ({str(e)[:80]})")
        names = pf.schema_arrow.names
        col = field if field else next((c for c in TEXT_FIELDS if c in names), None)
        if col not in names:
            raise SkipFile(f"no text column ({field or '/'.join(TEXT_FIELDS)}); it has {', '.join(names)[:80]}")
        kind = pf.schema_arrow.field(col).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise SkipFile(f"column '{col}' holds {kind}, not text")
        row = 0
        for batch in pf.iter_batches(columns=[col], batch_size=1024):  # streams, one batch at a time
            for text in batch.column(0).to_pylist():
                row += 1
                yield f"row {row}", text, None if text is not None else f"'{col}' is null"
    elif ext == ".json":
        text = "".join(t for _, t in decoded(path))
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise SkipFile(f"malformed JSON ({e.msg} at line {e.lineno} column {e.colno})")
        items = enumerate(obj, 1) if isinstance(obj, list) else [(0, obj)]
        for i, item in items:
            yield (f"item {i}" if i else ""), *record_text(item, field)
    else:
        yield "", read_text(path, dedup), None


def decoded(path):
    """Yield (bytes, text) of a UTF-8 file PIECE bytes at a time (gunzipped, byte-order mark removed);
    raise SkipFile at a NUL byte (binary) or at bytes that are not UTF-8."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0  # a character may span two reads
    with (gzip.open if path.name.lower().endswith(".gz") else open)(path, "rb") as f:
        while True:
            data = f.read(PIECE)
            if offset == 0 and data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise SkipFile("UTF-16 text (convert it to UTF-8)")
            if offset == 0 and data.startswith(codecs.BOM_UTF8):
                data, offset = data[3:], 3
            if b"\0" in data:
                raise SkipFile("binary (contains NUL bytes)")
            held = len(decoder.getstate()[0])  # bytes of a character the last read cut
            try:
                text = decoder.decode(data, final=not data)  # from bytes: line endings stay as they are
            except UnicodeDecodeError as e:
                raise SkipFile(f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {offset - held + e.start})")
            if not data:
                return
            yield data, text
            offset += len(data)


def read_text(path, dedup):
    """A plain-text file: its text when it fits in one read, else a BigText that this pass has checked
    whole, so that a bad byte late in a big file skips all of it before any of it is used."""
    first, n, nchars, blank = "", 0, 0, True
    digest = hashlib.blake2b(digest_size=16) if dedup else None
    for n, (data, text) in enumerate(decoded(path), 1):
        first = text  # the whole text if there is one read
        nchars += len(text)
        blank = blank and (not text or text.isspace())
        if digest:
            digest.update(data)
    return first if n <= 1 else BigText(path, nchars, blank, digest and digest.digest())


def pieces(doc, start=0, stop=None, whole=False):
    """Yield (text, is_last) for characters start:stop of a document: a str in one piece, a BigText
    in pieces of about one read, cut at its last SAFE_CUT (none in it: held until one comes), or whole."""
    if isinstance(doc, str):
        yield doc[start:stop], True
        return
    held, at = [], 0  # text read but not yet given out; characters read
    try:
        for _, text in decoded(doc.path):
            lo, at = at, at + len(text)
            if at <= start:
                continue
            text = text[max(start - lo, 0):None if stop is None else max(stop - lo, 0)]
            m = None if whole else LAST_CUT.match(text)
            if m:  # 0 < m.end() < len(text): SAFE_CUT looks one character back and ahead
                yield "".join(held) + text[:m.end()], False
                held = [text[m.end():]]
            else:
                held.append(text)
            if stop is not None and at >= stop:
                break
    except (SkipFile, OSError, EOFError, zlib.error) as e:  # it was whole when checked
        die(f"{doc.path} changed while it was read ({e}); run again")
    yield "".join(held), True


def tail_cut(doc, val_fraction):
    """Where the last val_fraction of a single document starts: the next line start (or the one before,
    with none after), as nanoGPT splits; read as a stream. None if that leaves a part empty."""
    nchars = doc.nchars if isinstance(doc, BigText) else len(doc)
    pos, before, at = int(nchars * (1 - val_fraction)), -1, 0
    for text, _ in pieces(doc):
        nl = text.find("\n", max(pos - at, 0))
        if nl != -1 and at + nl + 1 < nchars:
            return at + nl + 1
        nl = text.rfind("\n", 0, max(pos - at, 0))
        before = at + nl if nl != -1 else before
        at += len(text)
    cut = before + 1 if before != -1 else pos
    return cut if 0 < cut < nchars else None


def new_stats():
    return {"files_read": 0, "skipped": [], "hidden": 0, "bad_records": 0, "bad_examples": [],
            "empty": 0, "duplicates": 0, "by_ext": {}}


def corpus(inputs, args, stats, only_py=False, exclude=None):
    """Yield (key, ext, text or BigText) for every accepted document of inputs, in a fixed order.
    key names the document (path within its INPUT, position) for the train/val split."""
    seen = set()  # 16-byte digests of the documents kept, for --dedup

    def reject(where, why, file_level):
        where = where.encode("utf-8", "backslashreplace").decode()  # a file name that isn't UTF-8
        if args.strict:
            die(f"{where}: {why} (fix or remove it, or run without --strict to skip it)")
        if file_level:
            stats["skipped"].append((where, why))
        else:
            stats["bad_records"] += 1
            if len(stats["bad_examples"]) < MAX_EXAMPLES:
                stats["bad_examples"].append(f"{where}: {why}")

    for root in inputs:
        for path, rel in input_files(root, stats, only_py, exclude):
            ext = file_ext(path)
            kept = 0
            try:
                for pos, doc, why in read_documents(path, args.field, args.dedup):
                    if why is not None:
                        reject(f"{path}:{pos}" if pos else str(path), why, file_level=False)
                        continue
                    big = isinstance(doc, BigText)
                    if doc.blank if big else not doc.strip():
                        stats["empty"] += 1  # empty or whitespace only: nothing to learn from
                        continue
                    if args.dedup:
                        digest = doc.digest if big else hashlib.blake2b(doc.encode("utf-8"), digest_size=16).digest()
                        if digest in seen:
                            stats["duplicates"] += 1
                            continue
                        seen.add(digest)
                    kept += 1
                    yield f"{rel}:{pos}", ext, doc
            except SkipFile as e:
                reject(str(path), str(e), file_level=True)
                continue
            except (OSError, EOFError, zlib.error) as e:  # permissions, broken links, corrupt gzip, ...
                why = {errno.ELOOP: "symlink loop", errno.ENOENT: "broken symlink"}.get(
                    getattr(e, "errno", None), f"unreadable ({getattr(e, 'strerror', None) or e})")
                reject(str(path), why + (f" after {kept} documents (those are kept)" if kept else ""), file_level=True)
                continue
            stats["files_read"] += 1
            ext_stats(stats, ext)["files"] += 1


def ext_stats(stats, ext):
    """The report's counts for one file extension."""
    return stats["by_ext"].setdefault(ext or "(none)", {"files": 0, "documents": 0, "bytes": 0, "tokens": 0})

# -----------------------------------------------------------------------------
# encoding: ~64 KB batches of documents and pieces, encoded by a pool of threads, results in order

def encode_batch(tok, texts, ends, is_val, dtype):
    """-> (train ids, val ids, tokens per text, bytes per text); a document's last piece ends with end-of-text."""
    ids = tok.encode_docs(texts, ends)
    parts = ([a for a, v in zip(ids, is_val) if not v], [a for a, v in zip(ids, is_val) if v])
    cat = [np.concatenate(p).astype(dtype) if p else np.empty(0, dtype) for p in parts]
    return cat[0], cat[1], [len(a) for a in ids], [len(t.encode("utf-8")) for t in texts]


def encoded(docs, tok, dtype, num_workers, whole=False):
    """docs: (is_val, ext, doc, start, stop) -> yields ([(is_val, is_last, ext)], (train ids, val ids,
    tokens, bytes)) per batch, one entry per piece. Batches don't depend on num_workers, so neither do
    the outputs."""
    items = ((text, end, is_val, ext) for is_val, ext, doc, start, stop in docs
             for text, end in pieces(doc, start, stop, whole))
    with ThreadPoolExecutor(num_workers) as pool:
        pending = deque()  # at most 2 batches per worker in flight: memory stays bounded
        batch, size = [], 0
        for item in chain(items, [None]):
            if item is not None:
                batch.append(item)
                size += len(item[0])
            if batch and (size >= BATCH_CHARS or item is None):
                texts, ends, flags, exts = zip(*batch)
                pending.append((list(zip(flags, ends, exts)), pool.submit(encode_batch, tok, texts, ends, flags, dtype)))
                batch, size = [], 0
            while pending and (len(pending) > 2 * num_workers or item is None):
                infos, fut = pending.popleft()
                try:
                    result = fut.result()
                except ValueError as e:  # a reused char vocabulary that lacks a character
                    die(f"{e} (use a tokenizer that covers this corpus)")
                yield infos, result

# -----------------------------------------------------------------------------
# the run: read -> (learn a vocabulary) -> encode -> write under .tmp names -> rename, meta.json last

def split_is_val(key, val_fraction):
    """A document's split, from a hash of its name: the same on every run and for any worker count."""
    h = int.from_bytes(hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")
    return h < val_fraction * 2**64


def move_last_doc(src, dst, nbytes):
    """Move the last nbytes of file src (one document's ids) to the end of file dst."""
    end = src.seek(0, 2)
    src.seek(end - nbytes)
    while chunk := src.read(1 << 24):  # a document may be big
        dst.write(chunk)
    src.truncate(end - nbytes)
    src.seek(0, 2)


def cpu_count():
    """The cores this process may use; all of them where the OS can't say (macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def human(n, unit=""):
    """15300000 -> '15.3M'; with unit 'B': '15.3 MB'."""
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return (f"{n:.0f}" if not suffix else f"{n:.1f}") + (" " if unit else "") + suffix + unit
        n /= 1000


def prepare(args, quiet=False):
    """Run prepare.py with parsed args; returns meta.json's content (or the --analyze report)."""
    t0 = time.time()
    say = (lambda *a: None) if quiet else print
    default = not args.input
    inputs = args.input or [sysconfig.get_paths()["stdlib"]]
    for p in inputs + (args.val_input or []):
        if not os.path.exists(p):
            die(f"no such input: {p} (check the path)")
    if not 0 <= args.val_fraction < 1:
        die(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    out = Path(args.out_dir or ("data/stdlib" if default else ""))
    if not args.analyze:
        if not args.out_dir and not default:
            die("where should the dataset go? (pass --out_dir DIR)")
        if out.exists() and not out.is_dir():
            die(f"--out_dir {out} is a file (pass a folder)")
    incomplete = not args.analyze and (out / MARKER).exists()  # a run killed while renaming: replace it
    if not args.analyze and ((out / "meta.json").exists() or (out / "train.bin").exists()):
        if not (args.overwrite or incomplete):
            die(f"{out} already holds a dataset (pass --overwrite to replace it)")
    exclude = out.resolve() if not args.analyze else None
    num_workers = max(1, args.num_workers or cpu_count())

    def documents(stats):  # -> (is_val, ext, doc, start, stop): characters start:stop of doc
        for key, ext, doc in corpus(inputs, args, stats, only_py=default, exclude=exclude):
            yield (args.val_input is None and split_is_val(key, args.val_fraction)), ext, doc, 0, None
        for key, ext, doc in corpus(args.val_input or [], args, stats, exclude=exclude):
            yield True, ext, doc, 0, None

    # the vocabulary, if the tokenizer learns one, from a first pass over the corpus, in pieces
    t_vocab = time.time()
    tok = make_tokenizer(args.tokenizer, lambda: (t for d in documents(new_stats()) for t, _ in pieces(d[2])))
    t_vocab = time.time() - t_vocab
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32

    stats = new_stats()
    docs = documents(stats)
    head = list(islice(docs, 2))  # peek: no documents, no output folder; one, split it by text
    if not head:
        report_skips(stats, say)
        die(f"no documents found in {', '.join(inputs)} (every file was skipped or empty; see above)")
    how = "val_input" if args.val_input else "hash of document name"
    single = len(head) == 1 and not args.val_input and args.val_fraction > 0 and not args.analyze
    if single:  # one document (tinyshakespeare): its tail is the validation text, as nanoGPT does
        _, single_ext, doc, _, _ = head[0]
        cut = tail_cut(doc, args.val_fraction)
        single = cut is not None
        if single:
            how = "tail of the single document, cut at a line start"
            head = [(False, single_ext, doc, 0, cut), (True, single_ext, doc, cut, None)]
    docs = chain(head, docs)
    created = not out.exists()
    files = {}
    if not args.analyze:
        out.mkdir(parents=True, exist_ok=True)
        files = {s: open(out / f"{s}.bin.tmp", "w+b") for s in ("train", "val")}  # truncates a killed run's
    try:
        split = {s: {"documents": 0, "tokens": 0, "bytes": 0} for s in ("train", "val")}
        last = {}  # split -> (tokens, bytes) of its last document, to move one if a split comes out empty
        hist = {}  # log2(document length in tokens) -> documents
        ndocs = -1 if single else 0  # its two parts are one document read
        n_doc = b_doc = 0  # tokens and bytes of the document so far (a big one comes in pieces)
        bar = tqdm(unit="B", unit_scale=True, disable=None if not quiet else True, desc="prepare", file=sys.stderr)
        t_enc = time.time()
        # SAFE_CUT is checked for these splitting patterns only; any other tokenizer gets whole documents
        whole = tok.kind == "huggingface" or (tok.kind == "tiktoken" and tok.name not in SAFE_ENCODINGS)
        for infos, (train_ids, val_ids, lens, sizes) in encoded(docs, tok, dtype, num_workers, whole):
            if files:
                files["train"].write(train_ids); files["val"].write(val_ids)
            for (is_val, end, ext), n, nbytes in zip(infos, lens, sizes):
                n_doc += n; b_doc += nbytes
                if not end:
                    continue
                s, e = split["val" if is_val else "train"], ext_stats(stats, ext)
                s["documents"] += 1; s["tokens"] += n_doc; s["bytes"] += b_doc
                e["documents"] += 1; e["tokens"] += n_doc; e["bytes"] += b_doc
                last["val" if is_val else "train"] = (n_doc, b_doc)
                k = (n_doc - 1).bit_length() - 1  # power-of-two bucket of the length without end-of-text
                hist[k] = hist.get(k, 0) + 1
                ndocs += 1
                n_doc = b_doc = 0
            bar.update(sum(sizes))
            bar.set_postfix(files=stats["files_read"], tokens=human(split["train"]["tokens"] + split["val"]["tokens"]), refresh=False)
        bar.close()
        t_enc = max(time.time() - t_enc, 1e-6)

        if single:
            ext_stats(stats, single_ext)["documents"] -= 1
        elif files and ndocs >= 2 and args.val_input is None and args.val_fraction > 0:
            for empty, full in (("val", "train"), ("train", "val")):
                if split[empty]["documents"] == 0:  # each split gets at least one document
                    n, nbytes = last[full]
                    move_last_doc(files[full], files[empty], n * np.dtype(dtype).itemsize)
                    split[full]["documents"] -= 1; split[full]["tokens"] -= n; split[full]["bytes"] -= nbytes
                    split[empty] = {"documents": 1, "tokens": n, "bytes": nbytes}
        if args.val_input and split["val"]["documents"] == 0:
            die(f"no documents found in --val_input {', '.join(args.val_input)} (check it)")
        if split["train"]["documents"] == 0 and not args.analyze:
            die(f"no training documents in {', '.join(inputs)} (check it)")

        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tok.vocab_size,
            "eot_id": tok.eot_id,
            "tokenizer": {"kind": tok.kind, "name": tok.name},
            "train": split["train"],
            "val": split["val"],
            "split": {"method": how, "val_fraction": None if args.val_input else args.val_fraction},
            "inputs": [str(p) for p in inputs],
            "val_inputs": [str(p) for p in args.val_input or []],
            "files_read": stats["files_read"],
            "extensions": stats["by_ext"],
            "skipped_files": [{"path": p, "reason": r} for p, r in stats["skipped"]],
            "hidden_skipped": stats["hidden"],
            "bad_records": {"count": stats["bad_records"], "examples": stats["bad_examples"]},
            "empty_documents": stats["empty"],
            "duplicates_dropped": stats["duplicates"],
            "document_tokens_histogram": {f"{2**k}-{2**(k+1)-1}": hist[k] for k in sorted(hist)},
        }
        if args.analyze:
            report_analyze(meta, tok, say)
            return meta
        meta["tokenizer"], tok_file = tok.save(out)
        for f in files.values():
            f.flush(); os.fsync(f.fileno()); f.close()
        # the old dataset stays whole until here; from the marker's creation to its removal, killed
        # or not, the folder says it is incomplete (train.py refuses it, a rerun replaces it)
        with open(out / MARKER, "w") as f:
            f.write("prepare.py stopped while writing this dataset: it is incomplete; run prepare.py again\n")
            f.flush(); os.fsync(f.fileno())
        (out / "meta.json").unlink(missing_ok=True)
        for name in ("train.bin", "val.bin") + ((tok_file,) if tok_file else ()):
            os.replace(out / (name + ".tmp"), out / name)
        (out / "meta.json.tmp").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        os.replace(out / "meta.json.tmp", out / "meta.json")
        (out / MARKER).unlink()
    finally:
        for f in files.values():
            f.close()
        for name in ("train.bin", "val.bin", "vocab.json", "tokenizer.json", "meta.json"):
            (out / (name + ".tmp")).unlink(missing_ok=True)
        if files and created and not any(out.iterdir()):
            out.rmdir()

    # the summary
    nbytes = split["train"]["bytes"] + split["val"]["bytes"]
    ntok = split["train"]["tokens"] + split["val"]["tokens"]
    say(f"read {stats['files_read']} files, {ndocs} documents, {human(nbytes, 'B')} -> {out}/"
        + (" (replacing the incomplete dataset a killed run had left there)" if incomplete else ""))
    say(f"tokenizer: {tok.name} (vocab {tok.vocab_size}, end-of-text {tok.eot_id}, {meta['dtype']})"
        + (f", learned in {t_vocab:.1f} s" if t_vocab > 0.5 else ""))
    for s in ("train", "val"):
        say(f"{s:>5}: {split[s]['documents']:>9,} documents {split[s]['tokens']:>13,} tokens")
    say(f"split: {how}")
    report_skips(stats, say)
    say(f"tokenized {human(nbytes, 'B')} in {t_enc:.2f} s with {num_workers} threads: "
        f"{nbytes / 1e6 / t_enc:.1f} MB/s, {human(ntok / t_enc)} tokens/s; {time.time() - t0:.1f} s in all")
    return meta


def report_skips(stats, say):
    if stats["skipped"]:
        say(f"skipped {len(stats['skipped'])} files:")
        for p, r in stats["skipped"]:
            say(f"  {p}: {r}")
    if stats["bad_records"]:
        say(f"skipped {stats['bad_records']} bad records" + (", the first:" if stats["bad_records"] > 20 else ":"))
        for ex in stats["bad_examples"][:20]:
            say(f"  {ex}")
    say(f"dropped {stats['empty']} empty documents, {stats['duplicates']} duplicates; "
        f"left out {stats['hidden']} hidden files and folders")


def report_analyze(meta, tok, say):
    ntok = meta["train"]["tokens"] + meta["val"]["tokens"]
    ndocs = meta["train"]["documents"] + meta["val"]["documents"]
    nbytes = meta["train"]["bytes"] + meta["val"]["bytes"]
    say(f"analyze (nothing written): {meta['files_read']} files, {ndocs:,} documents, "
        f"{human(nbytes, 'B')}, {ntok:,} tokens with {tok.name} (counting one end-of-text per document)")
    say(f"{'extension':>12} {'files':>8} {'documents':>10} {'bytes':>9} {'tokens':>12}")
    for ext, e in sorted(meta["extensions"].items()):
        say(f"{ext:>12} {e['files']:>8,} {e['documents']:>10,} {human(e['bytes'], 'B'):>9} {e['tokens']:>12,}")
    say("document length in tokens (without end-of-text):")
    top = max(meta["document_tokens_histogram"].values())
    for bucket, n in meta["document_tokens_histogram"].items():
        say(f"{bucket:>15} {n:>9,} {'#' * max(1, round(40 * n / top))}")
    stats = {"skipped": [(s["path"], s["reason"]) for s in meta["skipped_files"]], "hidden": meta["hidden_skipped"],
             "bad_records": meta["bad_records"]["count"], "bad_examples": meta["bad_records"]["examples"],
             "empty": meta["empty_documents"], "duplicates": meta["duplicates_dropped"]}
    report_skips(stats, say)

# -----------------------------------------------------------------------------
# --bench: our whole run (read, encode, write) against tiktoken's encode_ordinary_batch alone

def bench(args):
    tok = make_tokenizer(args.tokenizer, lambda: iter(()))
    if tok.kind != "tiktoken":
        die("--bench compares against tiktoken: pass a tiktoken encoding, e.g. --tokenizer=gpt2")
    inputs = args.input or [sysconfig.get_paths()["stdlib"]]
    texts = ["".join(t for t, _ in pieces(doc)) for _, _, doc in corpus(inputs, args, new_stats(), only_py=not args.input)]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    threads = max(1, args.num_workers or cpu_count())

    def timed(fn):  # (wall, CPU of all threads) seconds
        w, c = time.time(), time.process_time()
        fn()
        return time.time() - w, time.process_time() - c

    ceiling, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        run = argparse.Namespace(**{**vars(args), "out_dir": tmp, "overwrite": True, "analyze": False})
        for _ in range(5):  # side by side, alternating, the best of each: CPU timings are noisy
            ceiling.append(timed(lambda: tok.enc.encode_ordinary_batch(texts, num_threads=threads)))
            ours.append(timed(lambda: prepare(run, quiet=True)))
    (cw, cc), (ow, oc) = [(min(t[0] for t in ts), min(t[1] for t in ts)) for ts in (ceiling, ours)]
    print(f"bench: {mb:.1f} MB in {len(texts)} documents, {tok.name}, {threads} threads, best of 5")
    print(f"  tiktoken encode_ordinary_batch (text in memory): {mb / cw:6.1f} MB/s, {cc:.2f} s CPU")
    print(f"  prepare.py (read, encode, write the dataset):    {mb / ow:6.1f} MB/s, {oc:.2f} s CPU")
    print(f"  ratio: {cw / ow:.2f} of tiktoken's throughput ({cc / oc:.2f} by CPU time)")
    return {"ceiling_mb_s": mb / cw, "prepare_mb_s": mb / ow, "ratio": cw / ow, "cpu_ratio": cc / oc}

# -----------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Files and folders -> train.bin, val.bin, meta.json. Examples: see the top of prepare.py.")
    p.add_argument("input", nargs="*", help="files or folders (default: this Python's standard library, .py files)")
    p.add_argument("--out_dir", help="where the dataset goes (default for the stdlib corpus: data/stdlib)")
    p.add_argument("--tokenizer", default="gpt2", help="gpt2 | cl100k_base | o200k_base | ... | char | bpe:N | path to tokenizer.json | a prepared dataset folder")
    p.add_argument("--val_fraction", type=float, default=0.1, help="share of documents for validation (one document: its tail)")
    p.add_argument("--val_input", nargs="+", help="take validation documents from these files or folders instead")
    p.add_argument("--field", help="the JSON field or parquet column holding the text (default: text, content or body)")
    p.add_argument("--num_workers", type=int, default=0, help="encoder threads (default: all cores)")
    p.add_argument("--dedup", action="store_true", help="drop exact duplicate documents")
    p.add_argument("--strict", action="store_true", help="stop at the first bad file or record instead of skipping it")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out_dir")
    p.add_argument("--analyze", action="store_true", help="report files, documents, tokens and lengths; write nothing")
    p.add_argument("--bench", action="store_true", help="measure throughput against tiktoken's own batch encoder")
    p.error = lambda msg: die(f"{msg} (see python prepare.py --help)")  # one line, not usage + error
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return bench(args) if args.bench else prepare(args)


if __name__ == "__main__":
    main()
