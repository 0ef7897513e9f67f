"""nanoGPT's own datasets work as they are: a folder written the way nanoGPT's
data/shakespeare_char/prepare.py writes it (train.bin, val.bin, meta.pkl) is read by read_meta and
load_tokenizer with meta.pkl's vocabulary, and meta.pkl is read without running anything in it.
read_meta's answers for our meta.json, a damaged one, an unfinished dataset and a bare folder.
Run: python -m pytest -q tests/test_nanogpt_data.py"""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from helpers import CPU_ENV, ROOT, SHAKESPEARE
from lib.files import read_meta
from lib.tokenizer import load_tokenizer

# Used when tinyshakespeare is not beside the checkout: a few lines in its manner.
OWN_TEXT = """First Citizen:
Before we proceed any further, hear me speak.

All:
Speak, speak!

MENENIUS:
What work's, my countrymen, in hand? where go you
With bats and clubs? The matter? speak, I pray you. 3 ways; -- & Zounds!
"""


def nanogpt_char_folder(folder, text):
    """Write folder as nanoGPT's shakespeare_char/prepare.py does: the sorted characters of the text,
    ids as uint16 with no header and no end-of-text, the first 90% to train, and meta.pkl pickled with
    the default protocol. -> (chars, stoi)"""
    folder.mkdir(parents=True, exist_ok=True)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    n = int(len(text) * 0.9)
    np.array([stoi[c] for c in text[:n]], dtype=np.uint16).tofile(folder / "train.bin")
    np.array([stoi[c] for c in text[n:]], dtype=np.uint16).tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return chars, stoi


@pytest.fixture(scope="module")
def text():
    return SHAKESPEARE.read_text(encoding="utf-8") if SHAKESPEARE.exists() else OWN_TEXT * 50


def assert_one_line_error(call, *words):
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    return message

# -----------------------------------------------------------------------------
# a nanoGPT character dataset

def test_read_meta_takes_the_vocabulary_of_meta_pkl(tmp_path, text):
    chars, _ = nanogpt_char_folder(tmp_path / "shakespeare_char", text)
    meta = read_meta(tmp_path / "shakespeare_char")
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(chars) and meta["eot_id"] is None
    assert meta["tokenizer"]["kind"] == "nanogpt_char"
    if SHAKESPEARE.exists():
        assert meta["vocab_size"] == 65
    ids = np.fromfile(tmp_path / "shakespeare_char" / "train.bin", dtype=meta["dtype"])
    assert ids.max() < meta["vocab_size"]


def test_load_tokenizer_uses_nanogpts_ids(tmp_path, text):
    chars, stoi = nanogpt_char_folder(tmp_path / "shakespeare_char", text)
    tokenizer = load_tokenizer(tmp_path / "shakespeare_char")
    assert (tokenizer.vocab_size, tokenizer.eot_id) == (len(chars), None)
    sample = text[:5000]
    assert tokenizer.encode(sample) == [stoi[c] for c in sample]
    assert tokenizer.decode(tokenizer.encode(sample)) == sample
    train = np.fromfile(tmp_path / "shakespeare_char" / "train.bin", dtype=np.uint16)
    assert tokenizer.decode(train[:3000]) == text[:3000]
    # every real id decodes to its character, none to an end-of-text string
    assert tokenizer.decode(list(range(len(chars)))) == "".join(chars)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.encode("\u00e9" if "\u00e9" not in chars else "\u2603")


def test_ids_follow_meta_pkl_in_any_order(tmp_path):
    # nanoGPT sorts its characters, but the ids are whatever meta.pkl says
    chars = list("zy\n xa")
    (tmp_path / "d").mkdir()
    meta = {"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": {c: i for i, c in enumerate(chars)}}
    (tmp_path / "d" / "meta.pkl").write_bytes(pickle.dumps(meta))
    tokenizer = load_tokenizer(tmp_path / "d")
    assert tokenizer.encode("a\nzx y") == [5, 2, 0, 4, 3, 1]
    assert tokenizer.decode([5, 2, 0, 4, 3, 1]) == "a\nzx y"


def test_meta_json_comes_before_meta_pkl(tmp_path, text):
    nanogpt_char_folder(tmp_path / "d", text[:1000])
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 300, "eot_id": 299}))
    meta = read_meta(tmp_path / "d")
    assert (meta["dtype"], meta["vocab_size"], meta["eot_id"]) == ("uint32", 300, 299)

# -----------------------------------------------------------------------------
# meta.pkl is read as plain values only, and refused with one line otherwise

class RunsACommand:
    marker = None

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_pickle(folder, value, protocol=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.pkl").write_bytes(pickle.dumps(value, protocol=protocol))
    return folder


def refused_by_both(folder, *words):
    message = assert_one_line_error(lambda: read_meta(folder), str(folder / "meta.pkl"), *words)
    assert assert_one_line_error(lambda: load_tokenizer(folder)) == message
    return message


def test_malicious_meta_pkl_is_refused_and_runs_nothing(tmp_path):
    RunsACommand.marker = tmp_path / "pwned"
    itos = {0: "a", 1: "b"}
    good = {"vocab_size": 2, "itos": itos, "stoi": {"a": 0, "b": 1}}
    for i, value in enumerate([RunsACommand(), {**good, "stoi": RunsACommand()}, {**good, "extra": [RunsACommand()]}]):
        message = refused_by_both(write_pickle(tmp_path / str(i), value), "holds objects other than plain values",
                                  "not loaded")
        assert "posix.system" in message or "nt.system" in message
    assert not RunsACommand.marker.exists()


@pytest.mark.parametrize("value", [{"a": {1, 2}}, {"a": frozenset([1])}, {"a": b"bytes"}, {"a": np.arange(3)},
                                   {"a": bytearray(b"x")}], ids=["set", "frozenset", "bytes", "numpy", "bytearray"])
@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_values_that_are_not_plain_are_refused(tmp_path, value, protocol):
    refused_by_both(write_pickle(tmp_path / "d", value, protocol), "holds objects other than plain values")


@pytest.mark.parametrize("value", [
    [1, 2, 3],
    "just a string",
    {"vocab_size": 2, "itos": {0: "a", 1: "b"}},  # no stoi
    {"vocab_size": 3, "itos": {0: "a", 1: "b"}, "stoi": {"a": 0, "b": 1}},  # vocab_size disagrees
    {"vocab_size": 2, "itos": {0: "a", 2: "b"}, "stoi": {"a": 0, "b": 2}},  # ids not 0..n-1
    {"vocab_size": 2, "itos": {0: "a", 1: "a"}, "stoi": {"a": 0}},  # a character twice
    {"vocab_size": 2, "itos": {0: "ab", 1: "c"}, "stoi": {"ab": 0, "c": 1}},  # not single characters
    {"vocab_size": 0, "itos": {}, "stoi": {}},
])
def test_malformed_meta_pkl_is_refused(tmp_path, value):
    refused_by_both(write_pickle(tmp_path / "d", value), "is not nanoGPT's meta.pkl of a character dataset")


def test_damaged_or_self_referencing_pickle(tmp_path):
    folder = write_pickle(tmp_path / "d", {"vocab_size": 1, "itos": {0: "a"}, "stoi": {"a": 0}})
    data = (folder / "meta.pkl").read_bytes()
    (folder / "meta.pkl").write_bytes(data[: len(data) // 2])
    refused_by_both(folder, "is not a readable pickle")
    loop = []
    loop.append(loop)  # plain values, but the check of them must not go round forever
    write_pickle(folder, {"vocab_size": 1, "itos": {0: "a"}, "stoi": {"a": 0}, "loop": loop})
    assert read_meta(folder)["vocab_size"] == 1

# -----------------------------------------------------------------------------
# read_meta for everything else: our meta.json, a damaged one, an unfinished dataset, nothing at all

def test_meta_json_is_read_and_normalised(tmp_path):
    meta = {"format_version": 1, "dtype": "<u2", "vocab_size": 65, "eot_id": 64, "tokenizer": {"kind": "char"}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    assert read_meta(tmp_path) == {**meta, "dtype": "uint16"}


@pytest.mark.parametrize("content", [
    "{not json",
    "[1, 2]",
    json.dumps({"vocab_size": 65}),
    json.dumps({"dtype": "uint16"}),
    json.dumps({"dtype": "nonsense", "vocab_size": 65}),
    json.dumps({"dtype": "float32", "vocab_size": 65}),
    json.dumps({"dtype": "uint16", "vocab_size": "65"}),
    json.dumps({"dtype": "uint16", "vocab_size": 0}),
    json.dumps({"dtype": "uint16", "vocab_size": 65, "eot_id": "64"}),
])
def test_damaged_meta_json(tmp_path, content):
    (tmp_path / "meta.json").write_text(content)
    assert_one_line_error(lambda: read_meta(tmp_path), f"{tmp_path / 'meta.json'} is damaged (",
                          "); re-run prepare.py to write it again")



def test_a_newer_prepare_pys_folder_is_refused_not_misread(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 65, "format_version": 3}))
    assert_one_line_error(lambda: read_meta(tmp_path), f"{tmp_path / 'meta.json'} says format_version 3: a newer "
                          "prepare.py's, whose files this checkout would misread (it reads 2)")

def test_unfinished_dataset_is_refused(tmp_path, text):
    nanogpt_char_folder(tmp_path / "d", text[:1000])
    (tmp_path / "d" / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 65}))
    (tmp_path / "d" / "prepare.incomplete").write_text("prepare.py was killed here\n")
    expected = f"{tmp_path / 'd'} is a dataset prepare.py did not finish (re-run prepare.py)"
    for read in (read_meta, load_tokenizer):
        assert assert_one_line_error(lambda: read(tmp_path / "d")) == expected


def test_no_meta_at_all_is_gpt2(tmp_path):
    assert read_meta(tmp_path) == {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
                                           "tokenizer": {"kind": "tiktoken", "name": "gpt2"}}


# -----------------------------------------------------------------------------
# end to end: train.py sizes the model to meta.pkl's vocabulary, sample.py decodes with it


def test_a_nanogpt_folder_trains_and_samples_its_characters(tmp_path, text):
    import torch
    from helpers import TINY, run, script
    chars, _ = nanogpt_char_folder(tmp_path / "data", text)
    run(*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'out'}", "--max_iters=10",
        "--eval_interval=10")
    ckpt = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert ckpt["model_args"]["vocab_size"] == 64 * -(-len(chars) // 64)  # its characters padded, not GPT-2's
    done = script("sample.py", f"--out_dir={tmp_path / 'out'}", "--start=First", "--num_samples=1",
                  "--max_new_tokens=200")
    assert done.returncode == 0, done.stderr
    sample = done.stdout.split("\n---------------")[0]
    assert sample.startswith("First") and len(sample) > 150 and set(sample) <= set(chars) | {"\ufffd"}
    # a prompt past the model's block_size (TINY's 32) is said to be seen in part; --chat, which needs an
    # end-of-text token, is refused in one line
    done = script("sample.py", f"--out_dir={tmp_path / 'out'}", f"--start={text[:40]}", "--num_samples=1",
                  "--max_new_tokens=2")
    assert "note: the prompt is 40 tokens, of which the model sees the last 32 (its block_size)" in done.stderr
    done = script("sample.py", f"--out_dir={tmp_path / 'out'}", "--num_samples=3", "--max_new_tokens=5")
    assert done.returncode == 0 and done.stdout.count("\n---------------\n") == 3  # each sample, then its line
    done = script("sample.py", f"--out_dir={tmp_path / 'out'}", "--chat", "--start=hi")
    assert done.returncode == 1 and done.stderr.startswith("sample.py: --chat needs a model trained on conversations")
    # its output cut short by its reader (| head -1): no traceback
    reader = subprocess.Popen([sys.executable, "sample.py", f"--out_dir={tmp_path / 'out'}", "--device=cpu",
                               "--num_samples=200", "--max_new_tokens=50"], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, **CPU_ENV})
    try:
        reader.stdout.readline()
        reader.stdout.close()
        assert reader.wait(timeout=300) in (0, 1) and reader.stderr.read() == b""  # (0: it had printed all)
    finally:
        reader.kill()  # (gone already, but where the wait ran out)
