"""
Hostile and careless input (issue 30): each case either works correctly or ends in one line naming the problem
and the fix, within bounded memory and time. Small crafted inputs, table-driven; a subprocess only where the
one-line exit itself is what is tested.

    python -m pytest tests/test_hostile_input.py -q
"""

import json
import os
import signal
import struct
from contextlib import contextmanager
from dataclasses import asdict

import pytest
import torch

import checkpoint as ckpt
import hf
from model import GPT, GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@contextmanager
def deadline(seconds):
    # What today's code would do forever (a FIFO's open, two nested loops) fails the test instead of hanging it:
    # the alarm's exception interrupts the blocking call or the loop.
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def built_on_meta_only(monkeypatch, module):
    # A model of the lying sizes would take memory (or, of 10**9 blocks, time) without bound: it may only be
    # built on the meta device, as many blocks as the weights hold, to compare its shapes with theirs.
    def checked(config):
        assert torch.empty(0).device.type == "meta" and config.n_layer == TINY.n_layer, "built before checked"
        return GPT(config)
    monkeypatch.setattr(module, "GPT", checked)

# -----------------------------------------------------------------------------
# a Hugging Face folder's config.json against its safetensors headers, and its shard index


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    hf.save_pretrained(GPT(TINY), tmp_path / "model")
    return tmp_path / "model"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes, says", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
    ({"hidden_size": 10**7}, "shape"),
    ({"intermediate_size": 10**9}, "shape"),
    ({"vocab_size": 10**9}, "shape"),
    ({"num_hidden_layers": -1}, "num_hidden_layers|n_layer=-1"),
    ({"hidden_size": "32"}, "n_embd='32'"),
    ({"num_attention_heads": 0}, "n_head=0"),
    ({"rms_norm_eps": "tiny"}, "norm_eps='tiny'"),
    ({"max_position_embeddings": 10**12}, "block_size=1000000000000"),
])
def test_config_json_is_checked_against_the_weights_before_anything_is_built(folder, monkeypatch, changes, says):
    edit_config(folder, **changes)
    built_on_meta_only(monkeypatch, hf)
    with pytest.raises(ValueError, match=says):
        hf.load_pretrained(folder)


def test_the_checked_folder_still_loads(folder):
    model = hf.load_pretrained(folder)
    assert model.config.n_layer == 2 and model.config.n_embd == 32


def write_index(folder, shard):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("shard, says", [
    ("/etc/passwd", "not a file inside"),
    ("../other/model.safetensors", "outside"),
    ("link.safetensors", "outside"),
    ("fifo.safetensors", "not a regular file"),
    (7, "not a file inside"),
])
def test_a_shard_index_names_only_regular_files_inside_the_folder(folder, tmp_path, shard, says):
    (tmp_path / "other").mkdir()
    os.link(folder / "model.safetensors", tmp_path / "other" / "model.safetensors")
    os.symlink(tmp_path / "other" / "model.safetensors", folder / "link.safetensors")
    os.mkfifo(folder / "fifo.safetensors")
    write_index(folder, shard)
    with pytest.raises(ValueError, match=says):  # before any is opened: a FIFO's open would wait forever
        hf.safetensors_files(folder)


def test_integer_tensors_are_refused_where_floats_belong(folder):
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=torch.int32)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match="I32 values, not floating-point"):
        hf.load_pretrained(folder)


@pytest.mark.parametrize("header", [b"{}", b'{"__metadata__": {"format": "pt"}}'])
def test_a_safetensors_file_without_tensors_is_one_line(folder, header):
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="holds no tensors"):
        hf.load_pretrained(folder)

# -----------------------------------------------------------------------------
# a checkpoint's model_args against its tensors


def tiny_checkpoint(**args):
    torch.manual_seed(0)
    model = GPT(TINY)
    return {"model": model.state_dict(), "model_args": {**asdict(TINY), **args}, "config": {}}


@pytest.mark.parametrize("args, says", [
    ({"n_layer": 10**9}, "n_layer=1000000000, but its weights hold 2 blocks"),
    ({"n_layer": 1e9}, "n_layer=1000000000.0"),
    ({"n_embd": 10**8}, "shape"),
    ({"vocab_size": 10**9}, "shape"),
    ({"n_embd": -64}, "n_embd=-64"),
    ({"n_head": 0}, "n_head=0"),
    ({"n_embd": "32"}, "n_embd='32'"),
    ({"block_size": 10**12}, "block_size=1000000000000"),
])
def test_model_args_are_checked_against_the_tensors_before_anything_is_built(monkeypatch, args, says):
    built_on_meta_only(monkeypatch, ckpt)
    with pytest.raises(ValueError, match=says):
        ckpt.model_from_checkpoint(tiny_checkpoint(**args))


def test_a_checkpoint_with_tensors_its_model_lacks_is_one_line():
    checkpoint = tiny_checkpoint()
    checkpoint["model"]["blocks.0.extra"] = torch.zeros(3)
    with pytest.raises(ValueError, match="do not fit its model_args"):
        ckpt.model_from_checkpoint(checkpoint)


def test_an_empty_ckpt_pt_is_one_line(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        ckpt.load_checkpoint(tmp_path / "ckpt.pt")
