"""prepare.py: every tokenizer kind and input format round-trips, big files read in pieces encode
like the whole, bad input is skipped and listed, outputs are identical for any worker count, memory
stays flat, a killed run leaves nothing that looks finished. Run: python -m pytest -q tests/test_prepare.py"""

import codecs
import gzip
import hashlib
import json
import os
import random
import re
import signal
import string
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import prepare
from helpers import SHAKESPEARE, TIKTOKEN_CACHE, needs_tiktoken, script
from lib import sources
from lib.files import UserError
from lib.tokenizer import load_tokenizer, make_tokenizer
from lib.tokenizer_json import hf_tokenizer_files

REPO = Path(__file__).resolve().parents[1]


# -----------------------------------------------------------------------------
# helpers

DOCS = [
    "Hello, world!\nSecond line.\n",
    "# A heading\r\n\r\nWindows line endings stay.\r\n",
    "def f(x):\n    return x * 2  # ünïcödé, 日本語, emoji 🙂\n",
    "a literal <|endoftext|> inside a document is text, not the separator\n",
    "   leading spaces and a trailing tab\t",
    "short",
]


def write(path, data, raw=False):
    """Write str (as UTF-8) or bytes to path, gzipped when it ends with .gz (unless raw)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with (gzip.open if path.name.endswith(".gz") and not raw else open)(path, "wb") as f:
        f.write(data)
    return path


def text_tree(root, docs=DOCS):
    """docs as .txt/.md/.py files in nested folders."""
    exts = [".txt", ".md", ".py", ".rst"]
    for i, d in enumerate(docs):
        write(Path(root) / f"d{i % 3}" / f"sub{i % 2}" / f"doc{i}{exts[i % len(exts)]}", d)
    return root


def run(*argv):
    """prepare.py in this process; returns meta.json's content."""
    return prepare.main([str(a) for a in argv])


def cli(*argv, cwd=REPO):
    """prepare.py as a user runs it, through helpers.script (its main in this process: a CompletedProcess of its
    exit status, its stdout, and the one line its hook prints for a UserError)."""
    return script(REPO / "prepare.py", *argv, cwd=cwd)


def one_line_error(r, *words):
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prepare.py: "), r.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def read_split(out, split):
    """Decode a split back into its documents (split on end-of-text)."""
    meta = json.loads((Path(out) / "meta.json").read_text())
    tok = load_tokenizer(out)
    ids = np.fromfile(Path(out) / f"{split}.bin", dtype=meta["dtype"])
    assert ids.size == meta[split]["tokens"]
    assert ids.size == 0 or (ids.max() < meta["vocab_size"] and ids[-1] == meta["eot_id"])
    docs, start = [], 0
    for end in np.flatnonzero(ids == meta["eot_id"]):
        docs.append(tok.decode(ids[start:end].tolist()))
        start = end + 1
    assert len(docs) == meta[split]["documents"]
    return docs


def read_all(out):
    return read_split(out, "train") + read_split(out, "val")


def hf_tokenizer_json(folder, special=("<|endoftext|>",), prefix_space=False):
    """A tiny byte-level BPE made with the tokenizers library, saved as folder/tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer)
    Path(folder).mkdir(parents=True, exist_ok=True)
    tok.save(str(Path(folder) / "tokenizer.json"))
    return Path(folder)


def generated(path, mbytes, units, rng):
    """Write mbytes MB of units drawn at random, ~50 KB at a time (100 MB in a few seconds)."""
    with open(write(path, ""), "w", encoding="utf-8") as f:
        size = 0
        while size < mbytes * 1e6:
            chunk = "".join(rng.choices(units, k=max(1, 50_000 // len(units[0]))))
            f.write(chunk)
            size += len(chunk)
    return path


def random_lines(rng, n=1000):
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 9))) for _ in range(2000)]
    return [" ".join(rng.choices(vocab, k=rng.randint(5, 15))) + "\n" for _ in range(n)]


def words_corpus(folder, mbytes, nfiles=4, seed=0):
    """mbytes MB of generated .jsonl documents (~2-8 KB each), in nfiles files."""
    rng = random.Random(seed)
    lines = random_lines(rng)
    docs = [json.dumps({"text": "".join(rng.choices(lines, k=rng.randint(30, 100)))}) + "\n" for _ in range(300)]
    for i in range(nfiles):
        generated(Path(folder) / f"part{i}.jsonl", mbytes / nfiles, docs, rng)
    return folder


def text_file(path, mbytes, seed=0):
    """One plain-text document of mbytes MB, of random lines."""
    return generated(path, mbytes, random_lines(random.Random(seed)), random.Random(seed))

# -----------------------------------------------------------------------------
# tokenizers round-trip: decoding both splits gives back every document exactly

@pytest.mark.parametrize("kind", [pytest.param("gpt2", marks=needs_tiktoken), "char", "bpe:300", "hf"])
def test_roundtrip_every_tokenizer(tmp_path, kind):
    src, out = text_tree(tmp_path / "src"), tmp_path / "out"
    tokenizer = str(hf_tokenizer_json(tmp_path / "hf")) if kind == "hf" else kind
    meta = run(src, "--out_dir", out, "--tokenizer", tokenizer, "--val_fraction", 0.3)
    assert sorted(read_all(out)) == sorted(DOCS)
    assert meta["train"]["documents"] >= 1 and meta["val"]["documents"] >= 1
    assert meta["format_version"] == 2 and meta["dtype"] == "uint16"
    assert meta["files_read"] == len(DOCS) and meta["skipped_files"] == []
    tok = load_tokenizer(out)
    assert (tok.vocab_size, tok.eot_id) == (meta["vocab_size"], meta["eot_id"])
    if kind == "gpt2":
        assert (meta["vocab_size"], meta["eot_id"], meta["tokenizer"]) == (50257, 50256, {"kind": "tiktoken", "name": "gpt2"})
        assert tok.encode(DOCS[3]) == tok.enc.encode_ordinary(DOCS[3])  # the literal is text
    if kind == "char":
        chars = sorted(set("".join(DOCS)))
        assert meta["vocab_size"] == len(chars) + 1 and meta["eot_id"] == len(chars)
        assert tok.encode("ab") == [chars.index("a"), chars.index("b")]
    if kind == "bpe:300":
        assert (meta["vocab_size"], meta["eot_id"]) == (301, 300) and (out / "vocab.json").exists()
    if kind == "hf":  # copied: the dataset works without the original tokenizer.json
        assert (out / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()
        (tmp_path / "hf" / "tokenizer.json").unlink()
        assert load_tokenizer(out).decode(load_tokenizer(out).encode(DOCS[2])) == DOCS[2]
        assert meta["eot_id"] == tok.hf.token_to_id("<|endoftext|>")
    # each split keeps corpus order
    train = read_split(out, "train")
    assert train == [d for d in text_order(src) if d in train]


@pytest.mark.parametrize("kind", ["bpe:300", "hf"])
def test_learned_in_is_said_of_a_learned_tokenizer_only(tmp_path, monkeypatch, capsys, kind):
    # a tokenizer that takes 0.6 s to make: learned (bpe:N), it says so; loaded (Qwen2's 7 MB tokenizer.json), not
    def slow(*args):
        time.sleep(0.6)
        return make_tokenizer(*args)
    monkeypatch.setattr(prepare, "make_tokenizer", slow)
    tokenizer = str(hf_tokenizer_json(tmp_path / "hf")) if kind == "hf" else kind
    run(text_tree(tmp_path / "src"), "--out_dir", tmp_path / "out", "--tokenizer", tokenizer)
    assert ("learned in" in capsys.readouterr().out) == (kind == "bpe:300")


def test_a_corpus_too_small_for_the_vocabulary_asked_says_so(tmp_path, capsys):
    meta = run(text_tree(tmp_path / "src"), "--out_dir", tmp_path / "out", "--tokenizer", "bpe:4096")
    made = meta["vocab_size"] - 1  # bpe:N's N tokens, then end-of-text
    assert made < 4096 and meta["tokenizer"]["name"] == "bpe:4096"
    assert (f"note: the corpus held too little text to learn 4096 tokens: it has {made} and end-of-text (more text "
            f"gives more)") in capsys.readouterr().out
    # one token short is short; as many as it can make is no note
    for asked, short in ((made + 1, True), (made, False)):
        meta = run(text_tree(tmp_path / "src"), "--out_dir", tmp_path / "out", "--tokenizer", f"bpe:{asked}",
                   "--overwrite")
        assert meta["vocab_size"] == made + 1 and ("too little text" in capsys.readouterr().out) == short, asked
    # its dataset's tokenizer reused on other text: nothing is learned there, and nothing said of it
    (tmp_path / "other.txt").write_text("other text\n" * 50)
    run(text_tree(tmp_path / "src"), "--out_dir", tmp_path / "short", "--tokenizer", "bpe:4096")
    assert "too little text" in capsys.readouterr().out
    run(tmp_path / "other.txt", "--out_dir", tmp_path / "again", "--tokenizer", tmp_path / "short")
    assert "too little text" not in capsys.readouterr().out


def test_a_wordpiece_whose_characters_alone_pass_the_size_asked_says_so(tmp_path, capsys):
    # WordPiece keeps every character, alone and as a word's continuation (##c): 60 letters and digits make 120
    (tmp_path / "in.txt").write_text(" ".join(string.ascii_letters[i:] + string.digits for i in range(52)) * 20)
    meta = run(tmp_path / "in.txt", "--out_dir", tmp_path / "out", "--tokenizer", "wordpiece:100")
    assert meta["vocab_size"] > 100
    assert (f"note: the corpus's characters alone make {meta['vocab_size']} WordPiece tokens, more than the 100 "
            f"asked for") in capsys.readouterr().out


def text_order(src):
    """Documents of a text tree in the order prepare.py reads them (sorted paths)."""
    return [p.read_bytes().decode() for p in sorted(Path(src).rglob("*"), key=lambda p: p.relative_to(src).parts) if p.is_file()]


@needs_tiktoken
def test_uint32_for_big_vocab(tmp_path):
    out = tmp_path / "out"
    meta = run(text_tree(tmp_path / "src"), "--out_dir", out, "--tokenizer", "o200k_base")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] > 65536 and meta["eot_id"] == 199999
    assert (out / "train.bin").stat().st_size == 4 * meta["train"]["tokens"]
    assert sorted(read_all(out)) == sorted(DOCS)


@needs_tiktoken
def test_load_tokenizer_without_meta_is_gpt2(tmp_path):
    tok = load_tokenizer(tmp_path)  # nanoGPT's convention
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_reuse_a_datasets_tokenizer(tmp_path):
    run(text_tree(tmp_path / "a"), "--out_dir", tmp_path / "A", "--tokenizer", "char")
    write(tmp_path / "b" / "x.txt", "Hello again")
    meta = run(tmp_path / "b", "--out_dir", tmp_path / "B", "--tokenizer", tmp_path / "A")
    assert meta["vocab_size"] == json.loads((tmp_path / "A" / "meta.json").read_text())["vocab_size"]
    assert "".join(read_all(tmp_path / "B")) == "Hello again"  # one document: train is its head, val its tail
    write(tmp_path / "c" / "x.txt", "Zebra")  # 'Z' is not in A's characters
    r = cli(tmp_path / "c", "--out_dir", tmp_path / "C", "--tokenizer", tmp_path / "A")
    one_line_error(r, "'Z'", "not in the vocabulary")
    assert not (tmp_path / "C" / "meta.json").exists()
    for foreign in ('{"dtype": "uint16", "vocab_size": 10}', "[1]", '{"tokenizer": {"kind": 3}}',
                    '{"tokenizer": {"kind": "sentencepiece", "file": "vocab.json"}}'):  # not ours
        write(tmp_path / "D" / "meta.json", foreign)
        one_line_error(cli(tmp_path / "c", "--out_dir", tmp_path / "C", "--tokenizer", tmp_path / "D"),
                       "meta.json names no tokenizer as prepare.py writes it")


def test_a_chat_template_file_that_is_not_there_is_refused_before_anything_is_read(tmp_path):
    write(tmp_path / "src" / "a.txt", "hello")
    one_line_error(cli(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--chat_template",
                       tmp_path / "none.jinja"), "no such --chat_template file:", "chat_template.jinja")
    assert not (tmp_path / "out").exists()


def test_hf_tokenizer_without_eot_is_refused(tmp_path):
    folder = hf_tokenizer_json(tmp_path / "hf", special=("<pad>",))
    write(tmp_path / "src" / "a.txt", "hello")
    one_line_error(cli(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", folder), "end-of-text")

def test_a_sentencepiece_style_tokenizer_json_is_its_own_models(tmp_path):
    # a SentencePiece-style tokenizer.json as transformers converts one today (Mistral's): "\u2581" for a space, one
    # put before a text unless it begins with one, bytes outside the vocabulary as <0xNN>, and decoding that drops
    # the first space. Indented code then does not give its ids back through its text; the data is still what the
    # tokenizer makes (with its BOS), and a model folder holding the very same tokenizer.json is its model's
    # (train.py --init_from and eval.py --model check so; refused before)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from lib.files import read_meta
    from lib.tokenizer import check_tokenizer
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    specials = ["<unk>", "<s>", "</s>", *bytes_]
    tok.train_from_iterator(DOCS * 3, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    folder = tmp_path / "mistral"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    docs = [f"    def f{i}(x):\n        return x * {i}\n" for i in range(10)]
    for i, doc in enumerate(docs):
        write(tmp_path / "src" / f"{i}.py", doc)
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", folder, "--val_fraction=0.5")
    ids = np.concatenate([np.fromfile(tmp_path / "out" / f"{name}.bin", dtype=meta["dtype"])
                          for name in ("train", "val")])
    written = {tuple(doc) for doc in np.split(ids, np.flatnonzero(ids == 2) + 1)[:-1]}
    assert meta["val"]["documents"] and written == {tuple(tok.encode(doc).ids + [2]) for doc in docs}
    assert load_tokenizer(tmp_path / "out").decode(tok.encode(docs[0]).ids[1:]) != docs[0]  # no way back
    check_tokenizer(tmp_path / "out", read_meta(tmp_path / "out"), str(folder), tok.get_vocab_size())


# -----------------------------------------------------------------------------
# input formats

def test_input_formats(tmp_path):
    src = tmp_path / "src"
    write(src / "a.jsonl", "".join(json.dumps(o) + "\n" for o in [{"text": "from text"}, {"content": "from content", "x": 1}, {"body": "from body"}]))
    write(src / "b.json", json.dumps({"text": "one object"}))
    write(src / "c.json", json.dumps([{"text": "array one"}, {"content": "array two"}]))
    write(src / "d.txt.gz", "gzipped text\n")
    write(src / "e.jsonl.gz", json.dumps({"text": "gzipped jsonl"}) + "\n")
    write(src / "f.json.gz", json.dumps([{"text": "gzipped json"}]))
    write(src / "g.md", "# markdown\n")
    write(src / "deep" / "er" / "h.py", "print('nested')\n")
    write(src / "i.ndjson", json.dumps({"text": "ndjson too"}) + "\n")
    write(src / "k.TXT.GZ", gzip.compress(b"gzipped, named in capitals\n"), raw=True)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": [1, 2, 3], "text": ["parquet one", "parquet two", "parquet three"]}),
                   src / "j.parquet", row_group_size=2)
    out = tmp_path / "out"
    meta = run(src, "--out_dir", out, "--tokenizer", "char")
    expect = ["from text", "from content", "from body", "one object", "array one", "array two", "gzipped text\n",
              "gzipped jsonl", "gzipped json", "# markdown\n", "print('nested')\n", "ndjson too",
              "parquet one", "parquet two", "parquet three", "gzipped, named in capitals\n"]
    assert sorted(read_all(out)) == sorted(expect)
    assert meta["files_read"] == 11 and meta["skipped_files"] == [] and meta["bad_records"]["count"] == 0
    assert meta["extensions"][".jsonl"] == {"files": 1, "documents": 3, "bytes": 30, "tokens": 33}
    assert meta["extensions"][".parquet"]["documents"] == 3 and meta["extensions"][".txt.gz"]["files"] == 2


def test_a_parquet_value_that_is_not_utf8_skips_its_file_as_a_text_files_byte_does(tmp_path):
    # parquet's strings may hold any bytes: the file is skipped from there and listed, the other inputs prepared
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    values = pa.array([b"good one", b"bad \xff byte", b"good two"], type=pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": values}), tmp_path / "x.parquet")
    write(tmp_path / "y.txt", "another document")
    meta = run(tmp_path / "x.parquet", tmp_path / "y.txt", "--out_dir", tmp_path / "out", "--tokenizer", "char",
               "--val_fraction", "0")
    assert read_all(tmp_path / "out") == ["another document"]
    assert [s["reason"] for s in meta["skipped_files"]] == ["not UTF-8 (byte 0xff in a value)"]


def test_a_damaged_parquet_or_json_lines_named_json_is_skipped_in_one_line(tmp_path):
    # pyarrow's own errors past the file's footer (ArrowInvalid: a ValueError) skip the file, in one line
    pa = pytest.importorskip("pyarrow")

    def damaged():
        yield pa.RecordBatch.from_pydict({"text": ["kept"]})
        raise pa.ArrowInvalid("Index not in dictionary bounds\nmore of the library's lines")
    values = sources.parquet_values(damaged(), False)
    assert next(values) == "kept"
    with pytest.raises(sources.SkipFile, match=r"^unreadable \(ArrowInvalid: Index not in dictionary bounds\)$"):
        next(values)
    write(tmp_path / "lines.json", '{"text": "one"}\n{"text": "two"}\n')  # JSON Lines named .json (the Hub's way)
    write(tmp_path / "y.txt", "another document")
    meta = run(tmp_path / "lines.json", tmp_path / "y.txt", "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert [s["reason"] for s in meta["skipped_files"]] == [
        "malformed JSON (Extra data at line 2 column 1) (JSON Lines? name it .jsonl)"]


def test_field_option(tmp_path):
    write(tmp_path / "a.jsonl", json.dumps({"text": "not this", "article": "this one"}) + "\n")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"article": ["parquet article"]}), tmp_path / "b.parquet")
    meta = run(tmp_path / "a.jsonl", tmp_path / "b.parquet", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--field", "article")
    assert sorted(read_all(tmp_path / "out")) == ["parquet article", "this one"]
    # a parquet file without the column is skipped with its reason
    pq.write_table(pa.table({"other": ["x"]}), tmp_path / "c.parquet")
    meta = run(tmp_path / "a.jsonl", tmp_path / "c.parquet", "--out_dir", tmp_path / "out2", "--tokenizer", "char")
    assert [s["reason"][:14] for s in meta["skipped_files"]] == ["no text column"]


def test_tinyshakespeare_single_document_gets_its_tail_as_val(tmp_path):
    path = SHAKESPEARE
    if not path.exists():
        pytest.skip(f"no {path}")
    out = tmp_path / "out"
    meta = run(path, "--out_dir", out, "--tokenizer", "char")
    text = path.read_text()
    (train,), (val,) = read_split(out, "train"), read_split(out, "val")
    assert train + val == text and train.endswith("\n")  # cut at a line start
    assert 0.09 < len(val) / len(text) < 0.11
    assert meta["vocab_size"] == 66 and meta["eot_id"] == 65  # nanoGPT's 65 characters + end-of-text
    assert meta["train"]["tokens"] == len(train) + 1 and meta["val"]["tokens"] == len(val) + 1


def test_a_single_document_without_line_breaks_is_cut_at_a_word_and_says_so(tmp_path):
    write(tmp_path / "a.txt", " ".join(["alpha", "river", "gamma", "delta"] * 100))
    meta = run(tmp_path / "a.txt", "--out_dir", tmp_path / "out", "--tokenizer", "char")
    (train,), (val,) = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    assert train.endswith(" ") and val.startswith("alpha") and len(train) == 2160  # the next word start from 90%
    assert meta["split"]["method"] == "tail of the single document, cut at a word start"
    # a line start far from the fraction is no cut: one line break near the start gave val 99.99% of the text
    write(tmp_path / "c.txt", "Title\n" + "word " * 2000)
    meta = run(tmp_path / "c.txt", "--out_dir", tmp_path / "out3", "--tokenizer", "char")
    assert meta["split"]["method"].endswith("cut at a word start") and 995 <= meta["val"]["tokens"] <= 1010
    write(tmp_path / "b.txt", "長" * 100)  # no space either: where the fraction falls
    meta = run(tmp_path / "b.txt", "--out_dir", tmp_path / "out2", "--tokenizer", "char")
    assert meta["split"]["method"].endswith("cut at a character") and meta["val"]["tokens"] == 11


# -----------------------------------------------------------------------------
# big plain-text files: read and encoded in pieces, with the tokens of the whole

TRICKY = ["a", "Z", "word", "7", "123", " ", "  ", "\n", "\r\n", "\t", ".", "/", "'s", "中文", "é", "e\u0301",
          "\n\n", " \n", "_", "ǅ", "\u00a0", "²", "\r", "😀", ",", "(", "x1", "\u3000"]


def old_tail_cut(text, val_fraction):
    """The single-document split as it was on a whole str: the reference for the streamed one."""
    pos = int(len(text) * (1 - val_fraction))
    nl = text.find("\n", pos)
    if nl == -1 or nl + 1 >= len(text):
        nl = text.rfind("\n", 0, pos)
    return nl + 1 if nl != -1 else pos


def test_text_a_tokenizer_json_cannot_spell_is_counted_and_said(tmp_path, capsys):
    # a WordPiece (or Unigram) tokenizer.json writes [UNK] for a word with a character it lacks: that text is gone
    # from the data, and nothing said so
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world"] * 10, trainers.WordPieceTrainer(
        vocab_size=60, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))
    (tmp_path / "hf").mkdir()
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    meta = run(write(tmp_path / "a.txt", "hello world\n" * 20 + "hello \ua66e\ua66e world\n" + "world hello\n" * 5),
               "--out_dir", tmp_path / "out", "--tokenizer", tmp_path / "hf")
    assert meta["unknown_tokens"] == 1
    assert "1 tokens are the tokenizer's unknown token: text it cannot spell" in capsys.readouterr().out
    meta = run(tmp_path / "a.txt", "--out_dir", tmp_path / "out2", "--tokenizer", hf_tokenizer_json(tmp_path / "bpe"))
    assert meta["unknown_tokens"] == 0  # a byte-level BPE spells every text


def test_a_tokenizer_json_with_bpe_dropout_is_refused(tmp_path):
    # it spells a text another way on every call: two preparations of one corpus gave other tokens (23,390 and 23,428)
    folder = hf_tokenizer_json(tmp_path / "hf")
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["dropout"] = 0.3
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    write(tmp_path / "a.txt", "hello world\n" * 10)
    assert "has BPE dropout 0.3: it spells a text another way each time" in refusal(
        tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", folder)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=needs_tiktoken) for k in ("gpt2", "cl100k_base", "o200k_base")]
                         + ["bpe:300", "char", "hf"])
def test_big_file_in_pieces_encodes_like_the_whole(tmp_path, monkeypatch, kind):
    text = "".join(random.Random(0).choices(TRICKY, k=20000))  # ~50 KB of what regex pre-tokenizers trip on
    path = write(tmp_path / "big.txt.gz", "\ufeff" + text)  # gzipped, with a byte-order mark
    monkeypatch.setattr(sources, "PIECE", 512)  # ~100 reads, characters split between them
    doc = sources.read_text(path, dedup=True)
    assert isinstance(doc, sources.BigText) and doc.nchars == len(text) and not doc.blank
    assert doc.digest == hashlib.blake2b(text.encode(), digest_size=16).digest()
    parts = list(sources.pieces(doc))
    assert "".join(p for p, _ in parts) == text and len(parts) > 50
    assert [end for _, end in parts] == [False] * (len(parts) - 1) + [True]
    tok = make_tokenizer(str(hf_tokenizer_json(tmp_path / "hf")) if kind == "hf" else kind, lambda: [text])
    if kind != "hf":  # a tokenizer.json gets whole documents: its pre-tokenizer could be anything
        assert sum((tok.encode(p) for p, _ in parts), []) == tok.encode(text)
    if kind == "gpt2":  # why SAFE_CUT is narrower than "after a newline before a non-space"
        assert tok.encode("Z\n\nX") != tok.encode("Z\n\n") + tok.encode("X")
    # through prepare.py: one document, so its tail is val, cut at a line start; each half as if whole
    out = tmp_path / "out"
    meta = run(path, "--out_dir", out, "--tokenizer", tok.name if kind != "hf" else tmp_path / "hf")
    (train,), (val,) = read_split(out, "train"), read_split(out, "val")
    assert train + val == text and len(train) == old_tail_cut(text, 0.1)
    for split, part in (("train", train), ("val", val)):
        assert np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])[:-1].tolist() == tok.encode(part)
    if kind == "bpe:300":  # learned from the pieces, the same as from the whole text
        assert load_tokenizer(out).ranks == tok.ranks


def test_a_tokenizer_that_puts_a_space_before_a_text_adds_none_where_a_big_file_is_cut(tmp_path, monkeypatch):
    # a tokenizer.json gets a document whole up to HARD_CUT characters, then a piece; one whose ByteLevel step adds
    # a space before a text's first word ('Ġhello') added one inside the text at each cut ('hell o'): it is cut before
    # a space, which such a piece keeps as it is. (The first word of each document gets its space, as ever.)
    monkeypatch.setattr(sources, "PIECE", 512)
    monkeypatch.setattr(sources, "HARD_CUT", 3000)
    text = "hello world\n" * 2000
    meta = run(write(tmp_path / "a.txt", text), "--out_dir", tmp_path / "out", "--tokenizer",
               hf_tokenizer_json(tmp_path / "hf", prefix_space=True))
    (train,), (val,) = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    assert meta["hard_cuts"] >= 7 and train.startswith(" hello") and val.startswith(" hello")
    assert train[1:] + val[1:] == text


def test_bad_byte_late_in_a_big_file_skips_all_of_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE", 256)
    src = tmp_path / "src"
    make_good(src)
    body = "Ωmega line of text\n" * 200  # Ω: in no accepted document
    write(src / "late.txt", body.encode() + b"\xff tail\n")
    write(src / "late_nul.txt.gz", body.encode() + b"\x00 tail\n")
    write(src / "split_char.txt", b"x" * 255 + "é".encode() + b"\xe6\x97")  # é across two reads, then cut short
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert "".join(read_all(tmp_path / "out")) == "good document"
    assert meta["vocab_size"] == len(set("good document")) + 1  # nothing of them reached the vocabulary
    reasons = {Path(s["path"]).name: s["reason"] for s in meta["skipped_files"]}
    n = len(body.encode())
    assert reasons == {"late.txt": f"not UTF-8 (byte 0xff at offset {n})", "late_nul.txt.gz": "binary (contains NUL bytes)",
                       "split_char.txt": "not UTF-8 (byte 0xe6 at offset 257)"}


def test_big_files_dedup_and_blank(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "PIECE", 256)
    text = "the same long document\n" * 100
    write(tmp_path / "src" / "a.txt", text)
    write(tmp_path / "src" / "b.txt.gz", "\ufeff" + text)
    write(tmp_path / "src" / "c.jsonl", json.dumps({"text": text}) + "\n" + json.dumps({"text": "other"}) + "\n")
    write(tmp_path / "src" / "d.txt", " \n\t" * 500)
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--dedup")
    assert sorted(read_all(tmp_path / "out")) == ["other", text]
    assert meta["duplicates_dropped"] == 2 and meta["empty_documents"] == 1


def test_at_least_one_val_document(tmp_path):
    write(tmp_path / "src" / "a.txt", "first")
    write(tmp_path / "src" / "b.txt", "second")
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction", 0.001)
    assert meta["train"]["documents"] == 1 and meta["val"]["documents"] == 1
    assert sorted(read_all(tmp_path / "out")) == ["first", "second"]


def test_a_split_by_name_that_leaves_train_the_smaller_part_says_so(tmp_path, capsys):
    # a preface and a book: the one val document moved to val is the book, and train keeps the preface alone
    write(tmp_path / "src" / "a.txt", "A short preface.")
    write(tmp_path / "src" / "b.txt", "lorem ipsum dolor\n" * 50)
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction", 0.001)
    assert (meta["train"]["tokens"], meta["val"]["tokens"]) == (17, 901)
    assert "warning: val holds 901 of the 918 tokens, train the rest: too few documents" in capsys.readouterr().out

# -----------------------------------------------------------------------------
# bad input: skipped, counted and listed with the reason; the good documents still arrive

def make_good(src):
    write(src / "good.txt", "good document")


def unreadable(src, monkeypatch):
    path = write(src / "secret.txt", "no access")
    if os.geteuid() != 0:
        path.chmod(0)
    else:  # root reads anything: simulate the permission error where prepare.py opens files
        real_open = open
        monkeypatch.setattr(sources, "open", lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                            if Path(p).name == "secret.txt" else real_open(p, *a, **k), raising=False)
    return path


BAD_FILES = {
    "binary": (lambda src, mp: write(src / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"), "binary"),
    "nul": (lambda src, mp: write(src / "nul.txt", "text with a \x00 NUL in it"), "NUL"),
    "not_utf8": (lambda src, mp: write(src / "latin1.txt", "caf\xe9".encode("latin-1")), "not UTF-8"),
    "unreadable": (unreadable, "Permission denied"),
    "broken_symlink": (lambda src, mp: os.symlink(src / "nowhere.txt", src / "broken.txt") or src / "broken.txt", "broken symlink"),
    "looping_symlink": (lambda src, mp: os.symlink(src / "loop.txt", src / "loop.txt") or src / "loop.txt", "symlink loop"),
    "corrupt_gzip": (lambda src, mp: write(src / "bad.txt.gz", gzip.compress(b"cut short " * 99)[:30], raw=True), "unreadable"),
    "malformed_json_file": (lambda src, mp: write(src / "bad.json", '{"text": "unclosed'), "malformed JSON"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_skipped_and_listed(tmp_path, monkeypatch, case):
    src = tmp_path / "src"
    make_good(src)
    make, reason = BAD_FILES[case]
    path = make(src, monkeypatch)
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert "".join(read_all(tmp_path / "out")) == "good document"
    assert [s["path"] for s in meta["skipped_files"]] == [str(path)]
    assert reason in meta["skipped_files"][0]["reason"]
    assert meta["files_read"] == 1


def test_skipped_files_are_counted_and_the_first_listed(tmp_path, monkeypatch, capsys):
    # every skipped file was listed in meta.json: a folder of 650K images beside its captions made one past the 64 MB
    # train.py reads, and prepared again the same
    monkeypatch.setattr(sources, "MAX_EXAMPLES", 2)
    write(tmp_path / "in" / "a.txt", "kept")
    for i in range(5):
        (tmp_path / "in" / f"{i}.jpg").write_bytes(b"\xff\xd8\xff\x00" * 4)
    meta = run(tmp_path / "in", "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert meta["files_skipped"] == 5 and len(meta["skipped_files"]) == 2
    assert "skipped 5 files:" in capsys.readouterr().out


def test_symlinked_folder_is_listed_not_followed(tmp_path):
    src = tmp_path / "src"
    make_good(src)
    os.symlink(src, src / "again")  # would read everything twice, or loop
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert "".join(read_all(tmp_path / "out")) == "good document"
    assert meta["skipped_files"][0]["path"] == str(src / "again") and "not followed" in meta["skipped_files"][0]["reason"]


def test_hidden_files_and_folders_are_left_out_and_counted(tmp_path):
    src = tmp_path / "src"
    make_good(src)
    write(src / ".hidden.txt", "hidden file")
    write(src / ".git" / "config", "hidden folder")
    write(src / "sub" / ".env", "hidden in a subfolder")
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert "".join(read_all(tmp_path / "out")) == "good document"
    assert meta["hidden_skipped"] == 3 and meta["skipped_files"] == []


BAD_RECORDS = [
    ('{"text": "unclosed', "malformed JSON"),
    ('{"title": "no text field"}', "no text field (text/content/body, or a conversation: messages, conversations, "
                                   "prompt+completion, instruction+output); it has title"),
    ('{"text": 42}', "field 'text' is not a string (int)"),
    ('["not", "an", "object"]', "not a JSON object (list)"),
    ('{"text": "\\ud800 lone surrogate"}', "lone surrogate"),
]


@pytest.mark.parametrize("line,reason", BAD_RECORDS)
def test_bad_record_is_skipped_with_file_and_line(tmp_path, line, reason):
    path = write(tmp_path / "a.jsonl", '{"text": "first"}\n\n' + line + '\n{"text": "last"}\n')
    meta = run(path, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert sorted(read_all(tmp_path / "out")) == ["first", "last"]
    assert meta["bad_records"]["count"] == 1
    assert meta["bad_records"]["examples"][0].startswith(f"{path}:3: ") and reason in meta["bad_records"]["examples"][0]
    # --strict stops there instead, with the position, and writes nothing
    r = cli(path, "--out_dir", tmp_path / "strict", "--tokenizer", "char", "--strict")
    one_line_error(r, f"{path}:3", reason, "--strict")
    assert not (tmp_path / "strict").exists()


def test_strict_stops_at_a_bad_file(tmp_path):
    src = tmp_path / "src"
    make_good(src)
    write(src / "latin1.txt", "caf\xe9".encode("latin-1"))
    one_line_error(cli(src, "--out_dir", tmp_path / "out", "--strict", "--tokenizer", "char"), "latin1.txt", "not UTF-8")


def test_empty_documents_are_dropped_and_counted(tmp_path):
    src = tmp_path / "src"
    make_good(src)
    write(src / "empty.txt", "")
    write(src / "blank.txt", " \n\t\r\n")
    write(src / "bom_only.txt", "\ufeff")
    write(src / "e.jsonl", '{"text": ""}\n{"text": "  "}\n{"text": "kept"}\n')
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert sorted(read_all(tmp_path / "out")) == ["good document", "kept"]
    assert meta["empty_documents"] == 5 and meta["files_read"] == 5


def test_bom_removed_and_line_endings_kept(tmp_path):
    src = tmp_path / "src"
    write(src / "a.txt", "\ufeffwith BOM\r\nCRLF\r\nand a lone CR\rhere\n")
    write(src / "b.jsonl", "\ufeff" + json.dumps({"text": "jsonl with BOM\r\n"}) + "\r\n")
    write(src / "c.json", "\ufeff" + json.dumps({"text": "json with BOM"}))
    run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert sorted(read_all(tmp_path / "out")) == sorted(["with BOM\r\nCRLF\r\nand a lone CR\rhere\n", "jsonl with BOM\r\n", "json with BOM"])


def test_missing_input_writes_nothing(tmp_path):
    said = refusal(tmp_path / "nope", "--out_dir", tmp_path / "out")
    assert "no such input" in said and str(tmp_path / "nope") in said
    assert not (tmp_path / "out").exists()


def test_no_documents_writes_nothing(tmp_path, capsys):
    src = tmp_path / "src"
    write(src / "empty.txt", "")
    write(src / "bin.dat", b"\x00\x01")
    for tokenizer in ("char", "gpt2") if TIKTOKEN_CACHE.is_dir() else ("char",):  # gpt2 only where it loads offline
        assert "no documents found" in refusal(src, "--out_dir", tmp_path / "out", "--tokenizer", tokenizer)
        assert "bin.dat: binary" in capsys.readouterr().out  # the reasons are still shown
        assert not (tmp_path / "out").exists()


def refusal(*argv):
    """The UserError prepare.py stops with, in this process: its one line."""
    with pytest.raises(UserError) as refused:
        run(*argv)
    assert len(str(refused.value).splitlines()) == 1, refused.value
    return str(refused.value)


def test_user_errors_are_one_line(tmp_path):
    write(tmp_path / "a.txt", "hello")
    said = refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", "wordpiece")
    assert said.startswith("unknown tokenizer 'wordpiece' (use char, bpe:N, wordpiece:N, a path to")
    write(tmp_path / "nanogpt" / "train.bin", b"\0\0")  # a nanoGPT dataset (its meta.pkl or none): no tokenizer.json
    said = refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", tmp_path / "nanogpt")
    assert said.startswith(f"{tmp_path / 'nanogpt'} is a nanoGPT dataset, whose tokenizer prepare.py does not reuse")
    write(tmp_path / "opt" / "pytorch_model.bin", b"\0\0")  # a model folder of vocab.json and merges.txt: what it is
    said = refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", tmp_path / "opt")
    assert said == f"no tokenizer.json at {tmp_path / 'opt'} (check the path)"
    with open(tmp_path / "huge.json", "wb") as f:  # sparse: read whole, it took 650 MB before the JSON error
        f.truncate((1 << 26) + 1)
    said = refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", tmp_path / "huge.json")
    assert said.startswith(f"{tmp_path / 'huge.json'} is 64 MB, past the 64 MB any such file needs")
    for spec in ("bpe:12", "bpe:\uff13\uff10\uff10", "bpe:99999999999"):  # (full-width digits: str.isdigit's;
        # a size past any vocabulary was a traceback from rustbpe, and wordpiece's an abort of the process)
        said = refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--tokenizer", spec)
        assert "bpe:N needs a whole number N from 256 to 16,777,216" in said
    assert "--val_fraction" in refusal(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--val_fraction", "1.5")
    assert "--out_dir" in refusal(tmp_path / "a.txt")
    # argparse's own refusal, and the script's one line on stderr (one_line_errors)
    one_line_error(cli(tmp_path / "a.txt", "--out_dir", tmp_path / "o", "--bogus"), "--bogus")
    assert not (tmp_path / "o").exists()

# -----------------------------------------------------------------------------
# options

@pytest.mark.slow
def test_identical_output_for_any_worker_count(tmp_path, monkeypatch):
    words_corpus(tmp_path / "src", 1.0, nfiles=3)  # ~15 batches
    text_tree(tmp_path / "src" / "txt")
    monkeypatch.setattr(sources, "PIECE", 4096)
    text_file(tmp_path / "src" / "big.txt", 0.2)  # ~50 pieces
    outs = []
    for i, workers in enumerate([1, 3, 2, 1]):
        out = tmp_path / f"out{i}"
        run(tmp_path / "src", "--out_dir", out, "--tokenizer", "bpe:300", "--num_workers", workers)
        outs.append([(out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json", "vocab.json")])
    assert all(o == outs[0] for o in outs)
    meta = json.loads(outs[0][2])
    assert meta["train"]["documents"] > 5 * meta["val"]["documents"] > 0


def test_dedup(tmp_path):
    src = tmp_path / "src"
    write(src / "a.txt", "same")
    write(src / "b.txt", "same")
    write(src / "c.jsonl", '{"text": "same"}\n{"text": "other"}\n{"text": "other"}\n')
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char", "--dedup")
    assert sorted(read_all(tmp_path / "out")) == ["other", "same"] and meta["duplicates_dropped"] == 3
    meta = run(src, "--out_dir", tmp_path / "out2", "--tokenizer", "char")
    assert len(read_all(tmp_path / "out2")) == 5 and meta["duplicates_dropped"] == 0
    write(tmp_path / "val" / "v.txt", "other")  # a --val_input whose one document training holds too
    one_line_error(cli(src, "--val_input", tmp_path / "val", "--out_dir", tmp_path / "out3", "--dedup",
                       "--tokenizer", "char"), "no documents left in --val_input", "(4 duplicates (--dedup) and 0 documents under --min_length")


def test_too_few_documents_to_split_are_refused_before_anything_is_written(tmp_path):
    # --val_fraction above 0 with one document left that cannot be cut in two (the other under --min_length, or a
    # single conversation): val.bin would be empty, which train.py refuses; prepare.py says why instead, and the
    # dataset already in --out_dir stays as it was
    write(tmp_path / "src" / "a.txt", "a long enough document here")
    write(tmp_path / "src" / "b.txt", "hi")
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char")
    before = {f: (tmp_path / "out" / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")}
    assert meta["train"]["documents"] == meta["val"]["documents"] == 1
    one_line_error(cli(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--min_length", "5",
                       "--overwrite"), "no document left for validation:", "gave 1, too few to split (0 duplicates "
                   "(--dedup) and 1 documents under --min_length were dropped in all; add documents, or give "
                   "--val_input)")
    assert {f: (tmp_path / "out" / f).read_bytes() for f in before} == before
    write(tmp_path / "chat.jsonl", json.dumps({"messages": [{"role": "user", "content": "hello"},
                                                            {"role": "assistant", "content": "hi there"}]}) + "\n")
    one_line_error(cli(tmp_path / "chat.jsonl", "--out_dir", tmp_path / "chat", "--tokenizer", "bpe:256"),
                   "no document left for validation:", "gave 1, too few to split (add documents, or give --val_input)")
    assert not (tmp_path / "chat").exists()


def test_val_input(tmp_path):
    text_tree(tmp_path / "train")
    write(tmp_path / "val" / "v1.txt", "validation one")
    write(tmp_path / "val" / "v2.jsonl", '{"text": "validation two"}\n')
    meta = run(tmp_path / "train", "--val_input", tmp_path / "val", "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert read_split(tmp_path / "out", "val") == ["validation one", "validation two"]
    assert sorted(read_split(tmp_path / "out", "train")) == sorted(DOCS)
    assert meta["split"]["method"] == "val_input" and meta["val_inputs"] == [str(tmp_path / "val")]


def test_val_input_inside_an_input_is_not_trained_on_and_dedup_spans_both_splits(tmp_path):
    # corpus/ holding its val/ folder: those documents are val's alone; with --dedup a val document training holds
    # too (here a copy under another name) is dropped from val, so the val loss is never of trained text
    text_tree(tmp_path / "corpus")
    write(tmp_path / "corpus" / "val" / "v1.txt", "validation one")
    write(tmp_path / "corpus" / "val" / "v2.txt", DOCS[0])
    meta = run(tmp_path / "corpus", "--val_input", tmp_path / "corpus" / "val", "--out_dir", tmp_path / "out",
               "--tokenizer", "char", "--dedup")
    assert sorted(read_split(tmp_path / "out", "train")) == sorted(DOCS)
    assert read_split(tmp_path / "out", "val") == ["validation one"] and meta["duplicates_dropped"] == 1
    write(tmp_path / "more.json", '{"text": ' + "1" * 5000 + "}")  # past Python's digits: skipped, listed
    meta = run(tmp_path / "more.json", tmp_path / "corpus" / "val", "--out_dir", tmp_path / "out2",
               "--tokenizer", "char")
    assert meta["skipped_files"][0]["reason"].startswith("malformed JSON")
    assert meta["train"]["documents"] + meta["val"]["documents"] == 2


def test_no_file_is_read_twice_nor_a_val_file_through_a_link(tmp_path):
    # inputs that overlap would put a document in both splits; a link in the corpus to a --val_input file too
    text_tree(tmp_path / "corpus")
    for again in ([tmp_path / "corpus"], [tmp_path / "corpus" / "d0"]):
        one_line_error(cli(tmp_path / "corpus", *again, "--out_dir", tmp_path / "out", "--tokenizer", "char"),
                       "overlap (the same, or one inside the other): pass each file once")
    write(tmp_path / "val" / "v.txt", "validation one")
    (tmp_path / "corpus" / "alias.txt").symlink_to(tmp_path / "val" / "v.txt")
    run(tmp_path / "corpus", "--val_input", tmp_path / "val" / "v.txt", "--out_dir", tmp_path / "out",
        "--tokenizer", "char")
    assert sorted(read_split(tmp_path / "out", "train")) == sorted(DOCS)
    one_line_error(cli(tmp_path / "corpus", "--val_input", tmp_path / "val" / "v.txt", tmp_path / "corpus" / "alias.txt",
                       "--out_dir", tmp_path / "out2", "--tokenizer", "char"),  # (it was in val twice)
                   "overlap (the same, or one inside the other): pass each file once")
    # the dataset in an input folder would be read as input by the next run there: refused (a folder inside is not)
    one_line_error(cli(tmp_path / "corpus", "--out_dir", tmp_path / "corpus", "--tokenizer", "char"),
                   f"--out_dir {tmp_path / 'corpus'} is the input {tmp_path / 'corpus'}: its dataset would be read")
    assert not (tmp_path / "corpus" / "meta.json").exists()


def test_a_file_named_again_by_a_link_is_read_once_and_listed(tmp_path):
    # a folder's link (or hard link) to a file read already, in its own folder or another input: read once, the other
    # name listed (it was read twice, in one split or both); a --val_input file is val's, however training names it
    text_tree(tmp_path / "corpus")
    write(tmp_path / "other" / "o.txt", "another input's document")
    write(tmp_path / "other" / "p.txt", "a document of val's, linked from training")
    (tmp_path / "corpus" / "again.txt").symlink_to(tmp_path / "corpus" / "d0" / "sub0" / "doc0.txt")
    (tmp_path / "corpus" / "z.txt").symlink_to(tmp_path / "other" / "o.txt")
    write(tmp_path / "val" / "w.txt", "a validation document")
    os.link(tmp_path / "other" / "p.txt", tmp_path / "val" / "v.txt")
    meta = run(tmp_path / "other", tmp_path / "corpus", "--val_input", tmp_path / "val", "--out_dir",
               tmp_path / "out", "--tokenizer", "char")
    assert sorted(read_split(tmp_path / "out", "train")) == sorted([*DOCS, "another input's document"])
    assert sorted(read_split(tmp_path / "out", "val")) == ["a document of val's, linked from training",
                                                           "a validation document"]
    # the name met second is listed: doc0.txt, after the folder's again.txt (sorted order); z.txt after the other
    # input's o.txt; p.txt, which training met first, as val's v.txt
    assert sorted(s["path"].rsplit("/", 1)[-1] for s in meta["skipped_files"]) == ["doc0.txt", "p.txt", "z.txt"]
    assert {s["reason"] for s in meta["skipped_files"]} == {
        "another name (a link) for a file read once, here or as --val_input's"}
    # an input that is another name for the --val_input file: no training documents, and what was skipped says why
    os.link(tmp_path / "val" / "w.txt", tmp_path / "t.txt")
    done = cli(tmp_path / "t.txt", "--val_input", tmp_path / "val" / "w.txt", "--out_dir", tmp_path / "out2",
               "--tokenizer", "char")
    one_line_error(done, "no training documents in")
    assert f"  {tmp_path / 't.txt'}: another name (a link) for a file read once" in done.stdout


def test_a_utf16_jsonl_is_skipped_whole_as_a_utf16_text_is(tmp_path):
    # each line after the first was read through json's own guess of its encoding (UTF-16), the first listed as a
    # bad record: the file was mostly read, and the report said one record was bad
    records = "".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(5))
    write(tmp_path / "u.jsonl", records.encode("utf-16"))
    write(tmp_path / "a.jsonl", records)
    meta = run(tmp_path / "u.jsonl", tmp_path / "a.jsonl", "--out_dir", tmp_path / "out", "--tokenizer", "char",
               "--val_fraction=0")
    assert sorted(read_split(tmp_path / "out", "train")) == [f"record {i}" for i in range(5)]
    assert meta["skipped_files"] == [{"path": str(tmp_path / "u.jsonl"), "reason": "UTF-16 text (convert it to UTF-8)"}]
    assert meta["bad_records"]["count"] == 0
    # files of a BOM each, joined by cat: a BOM mid-file begins a record as at the top (json's own guess took it)
    write(tmp_path / "joined.jsonl", (codecs.BOM_UTF8 + b"\n" + codecs.BOM_UTF8 + records.encode()) * 2)
    meta = run(tmp_path / "joined.jsonl", "--out_dir", tmp_path / "out2", "--tokenizer", "char", "--val_fraction=0")
    assert meta["train"]["documents"] == 10 and meta["bad_records"]["count"] == 0


def test_a_big_file_that_changes_length_while_read_is_one_line(tmp_path):
    # read_text counted its characters; the encoding pass reads it again: grown or shrunk meanwhile, it stops
    # (it was encoded as its new text, with --dedup's digest and the split of the old)
    path = write(tmp_path / "big.txt", "word " * 40000)
    doc = sources.read_text(path, dedup=False)
    assert isinstance(doc, sources.BigText)
    for changed in ("word " * 30000, "word " * 50000):
        path.write_text(changed)
        with pytest.raises(UserError, match=r"big.txt changed while it was read \(200,000 characters, then "):
            list(sources.pieces(doc))


def test_parquet_batches_of_big_rows_hold_a_few_rows(tmp_path):
    # rows of 240 KB in batches of 1,024 rows held 240 MB at once; a batch now holds about 4 MB of them
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rng = random.Random(0)
    rows = ["".join(rng.choices(string.ascii_letters, k=240_000)) for _ in range(40)]
    pq.write_table(pa.table({"text": rows}), tmp_path / "big.parquet", row_group_size=20)
    pq.write_table(pa.table({"text": ["tiny"] * 3000}), tmp_path / "small.parquet")
    big, small = (sources.batch_rows(pq.ParquetFile(tmp_path / name)) for name in ("big.parquet", "small.parquet"))
    assert 1 <= big * 240_000 <= 2**22 and small == 1024
    meta = run(tmp_path / "big.parquet", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction=0")
    assert meta["train"]["documents"] == 40 and meta["train"]["tokens"] == 40 * 240_001


def bos_tokenizer(path):
    # a tokenizer.json whose post-processor puts <s> before a text (Llama 3's way), a token per word of a, b, c
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    words = {"<|endoftext|>": 0, "<s>": 1, "[UNK]": 2, "a": 3, "b": 4, "c": 5}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens(["<|endoftext|>", "<s>"])
    tokenizer.save(str(path))
    return path


def test_a_folder_holding_the_datasets_bos_tokenizer_in_other_words_is_its_model(tmp_path):
    # the same tokenizer.json saved otherwise (compact) is compared by the ids it gives: each document read back
    # without the <s> it begins with, which encoding it again puts back
    from tokenizers import Tokenizer
    from lib.files import read_meta
    from lib.tokenizer import check_tokenizer
    tok = bos_tokenizer(tmp_path / "tok.json")
    for i in range(6):
        write(tmp_path / "docs" / f"{i}.txt", "a b c " * (i + 1))
    run(tmp_path / "docs", "--out_dir", tmp_path / "out", "--tokenizer", tok, "--val_fraction", 0.5)
    (tmp_path / "model").mkdir()
    Tokenizer.from_file(str(tok)).save(str(tmp_path / "model" / "tokenizer.json"), pretty=False)
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() != tok.read_bytes()
    check_tokenizer(tmp_path / "out", read_meta(tmp_path / "out"), str(tmp_path / "model"), 6)


def test_min_length_counts_a_documents_own_tokens_not_the_bos_its_tokenizer_adds(tmp_path):
    # a document of 2 words is under --min_length=3 words, its BOS and end-of-text beside it not counted (nor in the
    # length histogram)
    write(tmp_path / "docs" / "short.txt", "a b")
    write(tmp_path / "docs" / "long.txt", "a b c")
    meta = run(tmp_path / "docs", "--out_dir", tmp_path / "out", f"--tokenizer={bos_tokenizer(tmp_path / 'tok.json')}",
               "--min_length", "3", "--val_fraction", "0")
    assert meta["short_dropped"] == 1 and meta["train"]["documents"] == 1 and meta["train"]["tokens"] == 5
    assert meta["document_tokens_histogram"] == {"2-3": 1}


def test_min_length_weighs_a_document_encoded_in_pieces_as_a_whole_one(tmp_path, monkeypatch):
    # a document too long to encode at once (past HARD_CUT characters: made small here) comes in pieces: its BOS is
    # not counted either, as for a whole one (300 words: kept at --min_length=300, dropped at 301)
    monkeypatch.setattr(sources, "PIECE", 64)
    monkeypatch.setattr(sources, "HARD_CUT", 128)
    write(tmp_path / "docs" / "three_hundred.txt", "a b c " * 100)
    write(tmp_path / "docs" / "four_hundred.txt", "a b c d " * 100)  # (d: unknown, a token too)
    tokenizer = f"--tokenizer={bos_tokenizer(tmp_path / 'tok.json')}"
    for min_length, dropped in ((300, 0), (301, 1)):
        meta = run(tmp_path / "docs", "--out_dir", tmp_path / f"out{min_length}", tokenizer, "--min_length",
                   min_length, "--val_fraction", "0")
        assert meta["hard_cuts"] > 0 and meta["short_dropped"] == dropped
        assert meta["train"]["documents"] == 2 - dropped

def test_min_length_is_the_single_documents_whole_length_not_its_halves(tmp_path):
    # one document, cut into a train head and a val tail: --min_length weighs the whole document (1,640 characters),
    # never a half, so neither half is dropped; a document under it leaves nothing to train on, said in one line
    text = "".join(f"line {i} of the one document here\n" for i in range(50))
    write(tmp_path / "one.txt", text)
    meta = run(tmp_path / "one.txt", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--min_length", "1500")
    (train,), (val,) = read_split(tmp_path / "out", "train"), read_split(tmp_path / "out", "val")
    assert train + val == text and val and meta["short_dropped"] == 0
    assert meta["extensions"][".txt"]["documents"] == 1
    one_line_error(cli(tmp_path / "one.txt", "--out_dir", tmp_path / "out2", "--tokenizer", "char",
                       "--min_length", "1641"), "1,640 tokens", "--min_length=1641")
    assert not (tmp_path / "out2").exists()


def test_an_input_inside_a_val_input_is_refused(tmp_path):
    # trained on and validated on at once: the same folder, or a file of it, given as an input and as --val_input
    text_tree(tmp_path / "corpus")
    for given in (tmp_path / "corpus", tmp_path / "corpus" / "d0" / "sub0" / "doc0.txt"):
        one_line_error(cli(given, "--val_input", tmp_path / "corpus", "--out_dir", tmp_path / "out", "--tokenizer",
                           "char"), str(given), "--val_input")
    one_line_error(cli("hf:some/dataset", "--val_input", "hf:some/dataset", "--out_dir", tmp_path / "out"),
                   "hf:some/dataset:train is --val_input")  # (refused before the Hub is asked anything)
    assert not (tmp_path / "out").exists()


def test_a_link_named_in_bytes_that_are_not_utf8_is_listed_and_strict_stops_at_it(tmp_path):
    # a broken link (or any skipped path) whose name is not UTF-8 is listed with its bytes as \xNN text, in a
    # meta.json that can hold it; --strict stops at it, as at any file it would skip
    src = tmp_path / "src"
    make_good(src)
    os.symlink(b"/nonexistent", os.fsencode(src) + b"/bad\xff.txt")
    meta = run(src, "--out_dir", tmp_path / "out", "--tokenizer", "char")
    assert meta["skipped_files"] == [{"path": f"{src}/bad\\xff.txt", "reason": "broken symlink"}]
    assert json.loads((tmp_path / "out" / "meta.json").read_text()) == meta
    one_line_error(cli(src, "--out_dir", tmp_path / "strict", "--tokenizer", "char", "--strict"), "broken symlink")


def test_csv_and_tsv_rows_are_records_and_category_parquet_columns_are_text(tmp_path):
    # a .csv's header names its columns, each row a record (quoted commas and quotes kept as text); a .tsv the same
    # with tabs (its header after a BOM here, as Excel writes UTF-8); a parquet column pandas wrote as a category
    # holds strings too
    write(tmp_path / "src" / "a.csv", 'id,article\n1,"First, with a comma"\n2,"A ""quoted"" word"\n')
    write(tmp_path / "src" / "b.tsv", "\ufeffarticle\tid\ntab row\t3\n")
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"article": pa.array(["cat one", "cat two"]).dictionary_encode()}),
                   tmp_path / "src" / "c.parquet")
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--field", "article")
    assert sorted(read_all(tmp_path / "out")) == ['A "quoted" word', "First, with a comma", "cat one", "cat two",
                                                  "tab row"]
    assert meta["skipped_files"] == [] and meta["extensions"][".csv"]["documents"] == 2
    # a quoted field over two lines is one record, a bad record is named by its line in the file, and bytes that are
    # not UTF-8 skip the rest of a file, the records before them kept and said so
    write(tmp_path / "more" / "d.csv", 'article\n"two\nlines"\n"ok"\n')
    write(tmp_path / "more" / "e.csv", b'id,article\n1,fine\n2\n3,x\xff\n')
    meta = run(tmp_path / "more", "--out_dir", tmp_path / "out2", "--tokenizer", "char", "--field", "article")
    assert sorted(read_all(tmp_path / "out2")) == ["fine", "ok", "two\nlines"]
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'more' / 'e.csv'}:line 3: field 'article' is not a "
                                               f"string (NoneType)"]
    assert meta["skipped_files"][0]["reason"].endswith("after 1 documents (those are kept)")
    # in a .csv a quote left open runs to the file's end, taking the rows after it: the file stops there, its rows
    # before kept; a .tsv has no quoting: a line a record, its quotes text, none of them open
    write(tmp_path / "open" / "f.csv", 'id,text\n1,plain row\n2,"unclosed quote\n3,third row\n')
    write(tmp_path / "open" / "g.tsv", 'id\ttext\n1\t"Hi," she said\n2\t"unclosed\n3\tthird "row"\n')
    meta = run(tmp_path / "open", "--out_dir", tmp_path / "out3", "--tokenizer", "char", "--val_fraction", 0)
    assert sorted(read_all(tmp_path / "out3")) == ['"Hi," she said', '"unclosed', "plain row", 'third "row"']
    assert meta["skipped_files"][0]["reason"].startswith("not a readable csv file: the record at line 3 (unexpected end")


def test_a_csv_row_with_more_fields_than_its_header_or_past_a_records_bytes_is_refused(tmp_path, monkeypatch):
    # an unquoted comma in the text gives a row more fields than the header: where its text ends is unknown, a bad
    # record (it was read cut at the comma); a record past MAX_RECORD bytes (a quoted field over many lines, or
    # one line of countless fields) stops the file, never held whole
    write(tmp_path / "src" / "a.csv", "text,id\nHello, world,1\nfine,2\n")
    write(tmp_path / "src" / "twice.csv", "text,text\nfirst column,second column\n")  # a row keeps one of them
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction", "0")
    assert read_all(tmp_path / "out") == ["fine"]
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'src' / 'a.csv'}:line 2: 3 fields, the header names 2"]
    assert meta["skipped_files"] == [{"path": str(tmp_path / "src" / "twice.csv"),
                                      "reason": "its header names the column 'text' twice"}]
    import csv
    limit = csv.field_size_limit()
    monkeypatch.setattr(sources, "MAX_RECORD", 64)
    write(tmp_path / "big" / "b.csv", 'text\nshort\n"' + "long line\n" * 10 + '"\nafter\n')
    meta = run(tmp_path / "big", "--out_dir", tmp_path / "out2", "--tokenizer", "char", "--val_fraction", "0")
    assert read_all(tmp_path / "out2") == ["short"] and "a record over" in meta["skipped_files"][0]["reason"]
    assert csv.field_size_limit() == limit  # the csv module's own limit, every caller's, is put back


def test_analyze_writes_nothing(tmp_path, capsys):
    src = text_tree(tmp_path / "src")
    write(src / "bin.dat", b"\x00\x01")
    out = tmp_path / "out"
    report = run(src, "--analyze", "--out_dir", out, "--tokenizer", "char")
    assert not out.exists()
    assert report["files_read"] == len(DOCS) and report["skipped_files"][0]["reason"].startswith("binary")
    assert report["extensions"][".txt"]["files"] == 2 and sum(report["document_tokens_histogram"].values()) == len(DOCS)
    assert report["document_tokens_histogram"]["4-7"] == 1  # "short": 5 characters
    printed = capsys.readouterr().out
    assert "nothing written" in printed and "bin.dat: binary" in printed and "4-7" in printed


def test_existing_dataset_needs_overwrite(tmp_path):
    write(tmp_path / "a.txt", "first version")
    out = tmp_path / "out"
    assert cli(tmp_path / "a.txt", "--out_dir", out, "--tokenizer", "char").returncode == 0
    before = {f: (out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json")}
    write(tmp_path / "a.txt", "second version")
    one_line_error(cli(tmp_path / "a.txt", "--out_dir", out, "--tokenizer", "char"), "already holds", "--overwrite")
    assert {f: (out / f).read_bytes() for f in before} == before
    assert cli(tmp_path / "a.txt", "--out_dir", out, "--tokenizer", "char", "--overwrite").returncode == 0
    assert "".join(read_all(out)) == "second version"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]
    # replaced by one made with another kind of tokenizer, it keeps none of its files (vocab.json)
    assert cli(tmp_path / "a.txt", "--out_dir", out, "--tokenizer", hf_tokenizer_json(tmp_path / "hf"),
               "--overwrite").returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json", "train.bin", "val.bin"]
    # a folder of the user's that holds a file of a dataset's name alone (a model's tokenizer.json) keeps it too
    write(tmp_path / "model" / "tokenizer.json", '{"mine": 1}')
    one_line_error(cli(tmp_path / "a.txt", "--out_dir", tmp_path / "model", "--tokenizer", "char"),
                   "already holds tokenizer.json, which prepare.py would replace (pass --overwrite")
    assert (tmp_path / "model" / "tokenizer.json").read_text() == '{"mine": 1}'

# -----------------------------------------------------------------------------
# at scale: bounded memory, and a killed run leaves nothing that looks finished

def peak_rss_mb(src, out):
    """Peak resident memory of prepare.py in a fresh process. VmHWM, not ru_maxrss: Linux carries
    ru_maxrss over from the forking parent (pytest, holding the generated corpus) across exec."""
    code = ("import resource, sys; sys.path.insert(0, sys.argv[1]); import prepare; prepare.main(sys.argv[2:]); "
            "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')]; "
            "print(int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    r = subprocess.run([sys.executable, "-c", code, str(REPO), str(src), "--out_dir", str(out), "--tokenizer", "char"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1]) / 1024  # KB on Linux


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["many documents", "one big file"])
def test_memory_does_not_grow_with_corpus_size(tmp_path, shape):
    if shape == "many documents":  # 2 MB against 80 MB of .jsonl
        small, big = (words_corpus(tmp_path / name, mb, nfiles=4) for name, mb in (("small", 2), ("big", 80)))
    else:  # one .txt of 2 MB against one of 60 MB: read and encoded in pieces, its tail split off as val
        small, big = (text_file(tmp_path / name, mb) for name, mb in (("small.txt", 2), ("big.txt", 60)))
    small_mb, big_mb = peak_rss_mb(small, tmp_path / "o1"), peak_rss_mb(big, tmp_path / "o2")
    meta = json.loads((tmp_path / "o2" / "meta.json").read_text())
    assert meta["train"]["bytes"] + meta["val"]["bytes"] > (55e6 if shape == "one big file" else 75e6)  # it read all of it
    print(f"{shape}: peak RSS {small_mb:.0f} MB for the small corpus, {big_mb:.0f} MB for the big one")
    assert big_mb - small_mb < 25, f"peak RSS {small_mb:.0f} MB for the small corpus, {big_mb:.0f} MB for the big one"


@pytest.mark.slow
@pytest.mark.kills
def test_killed_run_leaves_nothing_finished(tmp_path):
    src = words_corpus(tmp_path / "src", 20, nfiles=4)
    out = tmp_path / "out"

    def start_and_kill(*extra):
        p = subprocess.Popen([sys.executable, str(REPO / "prepare.py"), str(src), "--out_dir", str(out),
                              "--tokenizer", "char", "--num_workers", "1", *extra],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not (out / "train.bin.tmp").exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)  # well inside the encoding pass
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert p.returncode == -signal.SIGKILL, "finished before it could be killed: make the corpus bigger"

    start_and_kill()
    assert (out / "train.bin.tmp").exists()
    assert not any((out / f).exists() for f in ("train.bin", "val.bin", "meta.json", "vocab.json"))
    r = cli(src, "--out_dir", out, "--tokenizer", "char")  # no --overwrite needed: nothing was finished
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]
    before = {f: (out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json", "vocab.json")}
    # killed while replacing a finished dataset: the old one is untouched
    write(src / "extra.txt", "one more document")
    start_and_kill("--overwrite")
    assert {f: (out / f).read_bytes() for f in before} == before


@pytest.mark.kills
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_removes_the_temporary_files_and_says_so_in_one_line(tmp_path, signum):
    # a scheduler's SIGTERM or a Ctrl-C, unlike a SIGKILL, lets prepare.py clean up: no .tmp file, no lock, no
    # folder it made
    src = words_corpus(tmp_path / "src", 10, nfiles=2)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, str(REPO / "prepare.py"), str(src), "--out_dir", str(out), "--tokenizer",
                          "char", "--num_workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "train.bin.tmp").exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # inside the encoding pass
    p.send_signal(signum)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 1, "finished before the signal: make the corpus bigger"
    assert err.strip().splitlines() == [f"prepare.py: stopped by {signum.name}; no dataset was written, and its "
                                        f"temporary files are removed"], err[-2000:]
    assert not out.exists()  # it made the folder, and leaves none


KILL_ON_SECOND_RENAME = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import prepare
real, calls = os.replace, []
def replace(*a):
    calls.append(a)
    if len(calls) == 2:  # train.bin is in place, val.bin and meta.json are not
        os.kill(os.getpid(), signal.SIGKILL)
    real(*a)
os.replace = replace
prepare.main(sys.argv[2:])
"""


@pytest.mark.parametrize("before", ["nothing", pytest.param("a finished dataset", marks=pytest.mark.slow)])
@pytest.mark.kills
def test_killed_while_renaming_leaves_a_marker_and_a_rerun_replaces_it(tmp_path, before):
    out = tmp_path / "out"
    if before != "nothing":
        write(tmp_path / "old.txt", "an older dataset")
        assert cli(tmp_path / "old.txt", "--out_dir", out, "--tokenizer", "char").returncode == 0
    write(tmp_path / "a.txt", "the new dataset")
    r = subprocess.run([sys.executable, "-c", KILL_ON_SECOND_RENAME, str(REPO), str(tmp_path / "a.txt"), "--out_dir", str(out),
                        "--tokenizer", "char", "--overwrite"], capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert (out / "prepare.incomplete").exists() and "incomplete" in (out / "prepare.incomplete").read_text()
    assert (out / "train.bin").exists() and not (out / "meta.json").exists()
    r = cli(tmp_path / "a.txt", "--out_dir", out, "--tokenizer", "char")  # no --overwrite needed
    assert r.returncode == 0, r.stderr
    assert "incomplete dataset" in r.stdout
    assert "".join(read_all(out)) == "the new dataset"
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]


@pytest.mark.kills
def test_a_sigterm_once_the_renames_begin_is_ignored_and_the_dataset_finishes(tmp_path):
    # stopped's line ("no dataset was written") would not be true once a rename is made: from the first one on, a
    # SIGTERM is ignored, and the dataset is written whole
    write(tmp_path / "a.txt", "the new dataset")
    script = KILL_ON_SECOND_RENAME.replace("SIGKILL", "SIGTERM").replace(
        "import prepare", "import prepare\nsignal.signal(signal.SIGTERM, prepare.stopped)")
    r = subprocess.run([sys.executable, "-c", script, str(REPO), str(tmp_path / "a.txt"), "--out_dir",
                        str(tmp_path / "out"), "--tokenizer", "char"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "stopped by" not in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]
    assert "".join(read_all(tmp_path / "out")) == "the new dataset"


def test_cpu_count_without_sched_getaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS has none
    assert prepare.cpu_count() == (os.cpu_count() or 1)


def test_out_dir_inside_the_input_is_not_read(tmp_path):
    src = text_tree(tmp_path / "src")
    for _ in range(2):  # the second run would otherwise read the first one's meta.json and vocab.json
        meta = run(src, "--out_dir", src / "data", "--tokenizer", "char", "--overwrite")
        assert meta["files_read"] == len(DOCS) and meta["skipped_files"] == [] and meta["bad_records"]["count"] == 0


def test_wordpiece_is_learned_saved_as_tokenizer_json_and_exported(tmp_path, capfd):
    # wordpiece:N: a WordPiece model in tokenizer.json; text comes back with its characters, whitespace
    # normalized as WordPiece does; transformers reads the exported folder's tokenizer to the same ids
    import re
    text = "".join(f"Line {i}: the quick brown fox, jumping over {i * 7} lazy dogs!\n" for i in range(400))
    (tmp_path / "in.txt").write_text(text)
    meta = prepare.main([str(tmp_path / "in.txt"), "--tokenizer=wordpiece:200", f"--out_dir={tmp_path / 'data'}"])
    said = capfd.readouterr().out  # prepare's report alone (the learner's progress bars had printed blank lines)
    assert said.startswith("read 1 files") and "\n\n" not in said, said
    assert meta["tokenizer"] == {"kind": "huggingface", "name": "wordpiece:200", "file": "tokenizer.json"}
    assert json.loads((tmp_path / "data" / "tokenizer.json").read_text())["model"]["type"] == "WordPiece"
    tok = load_tokenizer(tmp_path / "data")
    sample = "the quick fox, 12 dogs!\nLine   over"  # characters of the corpus (any other is [UNK])
    ids = tok.encode(sample)
    assert tok.decode([tok.eot_id]) == "<|endoftext|>" and tok.eot_id not in ids
    assert re.sub(r"\s", "", tok.decode(ids)) == re.sub(r"\s", "", sample)  # only whitespace changes
    assert tok.encode(tok.decode(ids)) == ids
    for size in ("x", "5000000000"):
        with pytest.raises(UserError, match="wordpiece:N needs a whole number N from 100 to"):
            prepare.main([str(tmp_path / "in.txt"), f"--tokenizer=wordpiece:{size}", f"--out_dir={tmp_path / 'bad'}"])
    transformers = pytest.importorskip("transformers")
    files, note = hf_tokenizer_files(tok)
    (tmp_path / "hf").mkdir()
    for name, content in files.items():
        (tmp_path / "hf" / name).write_text(content)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert note is None and theirs(sample, add_special_tokens=False)["input_ids"] == ids


def hub_folder(folder, splits):
    # a dataset laid out as a Hugging Face Hub repository: data files, and README.md's front matter naming them
    (folder / "data").mkdir(parents=True)
    front = ["---", "configs:", "- config_name: default", "  data_files:"]
    for split, records in splits.items():
        (folder / "data" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        front += [f"  - split: {split}", f"    path: data/{split}.jsonl"]
    (folder / "README.md").write_text("\n".join(front + ["---", "# a dataset made by the tests"]) + "\n")
    return folder


@pytest.mark.slow  # the datasets library's import alone is seconds
def test_hugging_face_datasets_by_name_with_their_validation_split(tmp_path, monkeypatch):
    # hf:PATH reads a local folder laid out as a Hub dataset through the datasets library, as a download would
    # be read: its train split is ours, its validation split our val; --min_length drops short documents
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = {split: [{"text": f"{split} {i} " + "ab" * i} for i in range(n)] for split, n in (("train", 30),
                                                                                             ("validation", 6))}
    folder = hub_folder(tmp_path / "ds", texts)
    meta = prepare.main([f"hf:{folder}", "--tokenizer=char", f"--out_dir={tmp_path / 'all'}"])
    assert meta["train"]["documents"] == 30 and meta["val"]["documents"] == 6 and meta["split"]["method"] == "val_input"
    val = np.fromfile(tmp_path / "all" / "val.bin", dtype=np.uint16)
    tok = load_tokenizer(tmp_path / "all")
    assert tok.decode(val.tolist()).split("<|endoftext|>")[:2] == ["validation 0 ", "validation 1 ab"]
    # --min_length=20 tokens (characters here): "train 6 " + 12 is 20, "train 5 " + 10 only 18: 6 dropped;
    # "validation 4 " + 8 is 21, "validation 3 " + 6 only 19: 4 dropped
    meta = prepare.main([f"hf:{folder}", "--tokenizer=char", f"--out_dir={tmp_path / 'long'}", "--min_length=20"])
    assert meta["short_dropped"] == 6 + 4 and meta["train"]["documents"] == 24 and meta["val"]["documents"] == 2
    # conversations in a column, as in files
    chats = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i}"}]}
             for i in range(12)]
    meta = prepare.main([f"hf:{hub_folder(tmp_path / 'chats', {'train': chats})}", "--tokenizer=bpe:260",
                         f"--out_dir={tmp_path / 'chat'}"])
    assert meta["masks"] and meta["train"]["documents"] + meta["val"]["documents"] == 12
    with pytest.raises(UserError, match=r"^cannot read the dataset hf:"):
        prepare.main([f"hf:{tmp_path / 'nothing'}", f"--out_dir={tmp_path / 'none'}"])
    # the library reads the folder whole: a --val_input file in it (or a file input in a val folder) would be in both
    # splits, and a dataset written into it would be read as its splits the next time
    for args in ([f"hf:{folder}", f"--val_input={folder / 'data' / 'validation.jsonl'}"],
                 [str(folder / "data" / "train.jsonl"), f"--val_input=hf:{folder}"]):
        with pytest.raises(UserError, match=r"overlap, and the datasets library reads the folder whole: move"):
            prepare.main([*args, f"--out_dir={tmp_path / 'none'}"])
    with pytest.raises(UserError, match=r"is inside hf:.*'s folder, which the datasets library reads whole"):
        prepare.main([f"hf:{folder}", f"--out_dir={folder / 'tokens'}"])
    assert not (tmp_path / "none").exists() and not (folder / "tokens").exists()
    # a split's file the library cannot read (a line of bad JSON) is named in one line, as a local file is
    broken = hub_folder(tmp_path / "broken", texts)
    with open(broken / "data" / "train.jsonl", "a") as f:
        f.write('{"text": no quotes}\n')
    with pytest.raises(UserError, match=rf"^hf:{re.escape(str(broken))}:train: unreadable \(\w+: .*JSON"):
        prepare.main([f"hf:{broken}", "--strict", "--tokenizer=char", f"--out_dir={tmp_path / 'none'}"])
    with pytest.raises(UserError, match=rf"^hf:{re.escape(str(folder))} has no split 'test': it has 'train', 'validation'$"):
        prepare.main([f"hf:{folder}:test", f"--out_dir={tmp_path / 'none'}"])


@pytest.mark.slow  # the datasets library's import alone is seconds
def test_hugging_face_dataset_folders_with_images_saved_to_disk_or_of_several_configurations(tmp_path, monkeypatch,
                                                                                           capsys):
    # media the text does not need are never opened (a path or URL in the file: read as data, not followed), and
    # a row whose image would not decode loses no text; a folder save_to_disk wrote is read; several configurations
    # are named with the option that chooses one
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    features = datasets.Features({"text": datasets.Value("string"), "image": datasets.Image(),
                                  "more": datasets.List(datasets.Image())})
    images = [{"bytes": None, "path": str(tmp_path / "no such image.png")}, {"bytes": b"not an image", "path": None}]
    rows = {"text": [f"caption {i}" for i in range(8)], "image": [images[i % 2] for i in range(8)],
            "more": [images for _ in range(8)]}
    (tmp_path / "img" / "data").mkdir(parents=True)
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")  # (to_parquet reads images in)
    pq.write_table(pa.Table.from_pydict(rows, schema=features.arrow_schema), tmp_path / "img/data/train.parquet")
    meta = prepare.main([f"hf:{tmp_path / 'img'}", "--tokenizer=char", f"--out_dir={tmp_path / 'a'}"])
    assert meta["train"]["documents"] + meta["val"]["documents"] == 8 and meta["skipped_files"] == []
    with pytest.raises(UserError, match="no documents found"):  # a column it lacks: said before any row is read
        prepare.main([f"hf:{tmp_path / 'img'}", "--field=body", "--tokenizer=char", f"--out_dir={tmp_path / 'x'}"])
    assert "train: no text column (body); it has text, image, more" in capsys.readouterr().out
    datasets.Dataset.from_dict({"text": [f"saved {i}" for i in range(6)]}).save_to_disk(tmp_path / "saved")
    meta = prepare.main([f"hf:{tmp_path / 'saved'}", "--tokenizer=char", f"--out_dir={tmp_path / 'b'}"])
    assert meta["train"]["documents"] + meta["val"]["documents"] == 6
    front = ["---", "configs:"]
    for config in ("en", "fr"):
        (tmp_path / "cfg" / config).mkdir(parents=True)
        (tmp_path / "cfg" / config / "train.jsonl").write_text(json.dumps({"text": config}) + "\n")
        front += [f"- config_name: {config}", "  data_files:", "  - split: train", f"    path: {config}/train.jsonl"]
    (tmp_path / "cfg" / "README.md").write_text("\n".join(front + ["---"]) + "\n")
    with pytest.raises(UserError, match=rf"^the dataset hf:{re.escape(str(tmp_path / 'cfg'))} has several "
                                        rf"configurations \(en, fr\): choose one with --hf_config=NAME$"):
        prepare.main([f"hf:{tmp_path / 'cfg'}", f"--out_dir={tmp_path / 'c'}"])
    meta = prepare.main([f"hf:{tmp_path / 'cfg'}", "--hf_config=fr", "--tokenizer=char", f"--out_dir={tmp_path / 'c'}",
                         "--val_fraction=0"])
    assert read_all(tmp_path / "c") == ["fr"]


def test_a_full_disk_leaves_the_dataset_there_before_usable_and_no_tmp_file(tmp_path, monkeypatch):
    # ENOSPC as the token files reach the disk (the fsync before any rename): the dataset there before is whole,
    # so no prepare.incomplete may say otherwise (train.py would refuse it), and no .tmp file may keep the disk full
    import errno
    write(tmp_path / "a.txt", "the dataset there before\n" * 50)
    out = tmp_path / "out"
    prepare.main([str(tmp_path / "a.txt"), f"--out_dir={out}", "--tokenizer=char"])
    before = {f: (out / f).read_bytes() for f in ("train.bin", "val.bin", "meta.json", "vocab.json")}

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match="is full"):
        prepare.main([str(tmp_path / "a.txt"), f"--out_dir={out}", "--tokenizer=char", "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]
    assert {f: (out / f).read_bytes() for f in before} == before
    from lib.files import read_meta
    assert read_meta(out)["train"]["tokens"] == len(before["train.bin"]) // 2


@pytest.mark.slow  # a prepare.py run a write: ~25 s
def test_a_full_disk_at_any_moment_leaves_the_old_dataset_usable_and_no_tmp_file(tmp_path):
    # a real full disk (a small tmpfs in a user namespace), at sizes that run out while encoding, at the buffered
    # tail's flush (a close in the cleanup that fails too) and while the marker is written
    if subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                      capture_output=True).returncode != 0:
        pytest.skip("no user namespace may mount a tmpfs here")
    write(tmp_path / "a.txt", "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(5000)))
    old = tmp_path / "old"
    prepare.main([str(tmp_path / "a.txt"), f"--out_dir={old}", "--tokenizer=char"])
    need = sum(p.stat().st_size for p in old.iterdir()) // 1024
    script = "; ".join(
        f"mkdir -p {tmp_path}/m{k} && mount -t tmpfs -o size={k}k tmpfs {tmp_path}/m{k} "
        f"&& cp -r {old} {tmp_path}/m{k}/d && {sys.executable} {REPO / 'prepare.py'} {tmp_path / 'a.txt'} "
        f"--out_dir={tmp_path}/m{k}/d --tokenizer=char --overwrite >/dev/null 2>{tmp_path}/err{k}; ls -A {tmp_path}/m{k}/d > {tmp_path}/ls{k}"
        for k in range(2 * need - 48, 2 * need + 24, 4))
    subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=REPO, timeout=600, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    for k in range(2 * need - 48, 2 * need + 24, 4):
        listing = (tmp_path / f"ls{k}").read_text().split()
        err = (tmp_path / f"err{k}").read_text() if (tmp_path / f"err{k}").exists() else "(not run)"
        assert listing == ["meta.json", "train.bin", "val.bin", "vocab.json"], (k, listing, err[-500:])


def test_a_dataset_finished_by_another_prepare_meanwhile_needs_overwrite(tmp_path, monkeypatch):
    # two prepare.py into one new folder: the second checked it empty at its start, then learned its vocabulary
    # while the first finished; it may not replace the first's dataset without --overwrite
    write(tmp_path / "a.txt", "the first dataset\n" * 20)
    write(tmp_path / "b.txt", "THE SECOND\n" * 20)
    out = tmp_path / "out"
    real = prepare.make_tokenizer

    def meanwhile(spec, texts):
        monkeypatch.setattr(prepare, "make_tokenizer", real)
        prepare.main([str(tmp_path / "a.txt"), f"--out_dir={out}", "--tokenizer=char"])  # the other one finishes
        return real(spec, texts)
    monkeypatch.setattr(prepare, "make_tokenizer", meanwhile)
    with pytest.raises(UserError, match="already holds .*pass --overwrite"):
        prepare.main([str(tmp_path / "b.txt"), f"--out_dir={out}", "--tokenizer=char"])
    assert "".join(read_all(out)).startswith("the first dataset")
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin", "vocab.json"]


def test_a_compressed_file_is_named_as_compressed_not_binary(tmp_path):
    import bz2
    import lzma
    text = b"a document to be read\n" * 20
    write(tmp_path / "src" / "a.txt.bz2", bz2.compress(text))
    write(tmp_path / "src" / "b.jsonl.xz", lzma.compress(text))
    write(tmp_path / "src" / "c.txt", gzip.compress(text))  # a gzip not named .gz
    write(tmp_path / "src" / "d.txt", b"BZh is how this text begins\n")
    write(tmp_path / "src" / "e.txt.gz", gzip.compress(gzip.compress(text)))  # gzipped twice: named .gz already
    write(tmp_path / "src" / "f.jsonl", gzip.compress(b'{"text": "a record"}\n' * 20))  # were bad records, not UTF-8
    write(tmp_path / "src" / "g.csv", gzip.compress(b"text\na row\n" * 20))  # was unreadable, a UnicodeDecodeError
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction=0")
    assert read_all(tmp_path / "out") == ["BZh is how this text begins\n"]
    assert {Path(s["path"]).name: s["reason"] for s in meta["skipped_files"]} == {
        "a.txt.bz2": "bzip2-compressed (decompress it to have it read)",
        "b.jsonl.xz": "xz-compressed (decompress it to have it read)",
        "c.txt": "gzip-compressed (name it .gz to have it read)",
        "e.txt.gz": "gzip-compressed (decompress it to have it read)",
        "f.jsonl": "gzip-compressed (name it .gz to have it read)",
        "g.csv": "gzip-compressed (name it .gz to have it read)"}


def test_a_json_past_what_is_read_whole_is_skipped_and_listed(tmp_path, monkeypatch):
    # a .json is parsed whole (40 MB of records: 600 MB of memory); a .jsonl is read a record at a time
    from lib import sources
    monkeypatch.setattr(sources, "MAX_JSON", 1000)
    records = [{"text": f"document {i} of a json array"} for i in range(40)]  # 1,400 bytes
    write(tmp_path / "src" / "big.json", json.dumps(records))
    write(tmp_path / "src" / "small.json", json.dumps(records[:20]))
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction=0")
    assert sorted(read_all(tmp_path / "out")) == sorted(r["text"] for r in records[:20])
    assert [(Path(s["path"]).name, s["reason"]) for s in meta["skipped_files"]] == [
        ("big.json", "a .json over 0 MB, which is read whole: make it JSON Lines (.jsonl, a record a line, read one "
                     "at a time)")]


def test_analyze_leaves_out_an_out_dir_inside_the_input_as_the_run_does(tmp_path):
    src = text_tree(tmp_path / "src")
    real = run(src, "--out_dir", src / "tok", "--tokenizer", "char")  # (a dataset inside what it reads)
    report = run(src, "--analyze", "--out_dir", src / "tok", "--tokenizer", "char")
    assert report["files_read"] == real["files_read"] == len(DOCS) and report["skipped_files"] == []


def test_too_few_documents_to_split_lists_what_was_skipped(tmp_path, capsys):
    # one example (a conversation is not cut in two, as one text is) and a file skipped: why there is one was unsaid
    write(tmp_path / "src" / "a.jsonl", '{"prompt": "a question", "completion": " an answer"}\n')
    write(tmp_path / "src" / "b.txt", b"\x00\x01 binary")
    with pytest.raises(UserError, match="no document left for validation"):
        run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "bpe:300")
    assert "b.txt: binary (contains NUL bytes)" in capsys.readouterr().out


def test_val_fraction_is_the_share_of_documents_in_val(tmp_path):
    # each document's name hashed picks its split: of 400 documents, --val_fraction=0.3 puts ~120 in val; the count
    # is fixed by the names (no draw at each run), and a binomial's 5 sigma (9.2 each) bounds it
    (tmp_path / "src").mkdir()
    for i in range(400):
        (tmp_path / "src" / f"doc{i}.txt").write_text(f"document {i}: a few words of its own\n")
    meta = run(tmp_path / "src", "--out_dir", tmp_path / "out", "--tokenizer", "char", "--val_fraction", 0.3)
    assert meta["train"]["documents"] + meta["val"]["documents"] == 400
    assert abs(meta["val"]["documents"] - 120) < 5 * (400 * 0.3 * 0.7) ** 0.5, meta["val"]


@pytest.mark.parametrize("words", [65535, 65536])
def test_ids_are_uint16_up_to_65536_of_them_and_uint32_past(tmp_path, words):
    # a vocabulary of the words and the end-of-text after them: 65,536 ids are uint16's every value, 65,537 are not
    # (the end-of-text, 65536, would be written as 0)
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({**{f"w{i}": i for i in range(words)}, "<|endoftext|>": words}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tok.json"))
    write(tmp_path / "docs" / "a.txt", f"w1 w{words - 1}")
    write(tmp_path / "docs" / "b.txt", "w2 w3")
    meta = run(tmp_path / "docs", "--out_dir", tmp_path / "out", "--tokenizer", tmp_path / "tok.json",
               "--val_fraction", 0)
    assert (meta["dtype"], meta["eot_id"]) == ("uint16" if words < 65536 else "uint32", words)
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype=meta["dtype"]).tolist()
    assert sorted(ids) == sorted([1, words - 1, words, 2, 3, words])
