"""A Hugging Face folder read as its config.json and weights say, or refused in one line; a LoRA checkpoint rebuilt
on the very base it began from, with its own adapters and the settings given (tests/test_pretrained.py's folders)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_pretrained import hf_folder, llama_copy  # noqa: F401 (fixtures)
from test_pretrained import (assert_refused, assert_same_logits, hf_load, hf_logits, our_logits, random_ids,
                             read_config, write_config)
from lib.files import UserError
from lib.hf import load_pretrained, save_pretrained
from model import GPT, GPTConfig


def test_a_folder_of_mixed_dtypes_loads_in_its_first_tensors(llama_copy):
    # as a release whose norms are kept in float32: the folder's dtype is its first tensor's (bfloat16 here)
    weights = load_file(llama_copy / "model.safetensors")
    mixed = {k: v if k == "model.norm.weight" else v.to(torch.bfloat16) for k, v in weights.items()}
    save_file(mixed, llama_copy / "model.safetensors", metadata={"format": "pt"})
    assert {p.dtype for p in load_pretrained(llama_copy).parameters()} == {torch.bfloat16}


def test_a_missing_shard_is_named_in_one_line(hf_folder, tmp_path):
    folder, _ = hf_folder("qwen3")
    save_pretrained(load_pretrained(folder), tmp_path, 50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    gone = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / gone).unlink()
    assert_refused(tmp_path, [f"lacks {gone}, a shard its model.safetensors.index.json names"])


def test_a_sliding_window_as_long_as_block_size_loads_and_a_shorter_is_refused(hf_folder, tmp_path):
    shutil.copytree(hf_folder("mistral_window")[0], tmp_path, dirs_exist_ok=True)
    write_config(tmp_path, {**read_config(tmp_path), "sliding_window": 16})
    assert load_pretrained(tmp_path, block_size=16).config.block_size == 16
    assert_refused(tmp_path, ["sliding_window of 16"], block_size=17)


def test_a_config_without_rms_norm_eps_or_tie_word_embeddings_reads_transformers_defaults(llama_copy):
    config = read_config(llama_copy)
    del config["rms_norm_eps"], config["tie_word_embeddings"]  # the fixture's llama has 1e-4, untied
    write_config(llama_copy, config)
    ids = random_ids()
    assert_same_logits(our_logits(load_pretrained(llama_copy), ids), hf_logits(hf_load(llama_copy), ids))


def test_an_exported_mistral_attends_without_a_window(tmp_path):
    model = GPT(GPTConfig(vocab_size=64, block_size=8192, n_layer=1, n_head=2, n_embd=32, family="mistral"))
    save_pretrained(model, tmp_path)
    assert read_config(tmp_path)["sliding_window"] is None
    assert load_pretrained(tmp_path, block_size=8192).config.block_size == 8192


def test_a_tensor_the_model_does_not_implement_is_refused(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    weights["model.layers.0.mlp.down_proj.bias"] = torch.zeros(weights["model.norm.weight"].shape)
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    assert_refused(llama_copy, ["model.layers.0.mlp.down_proj.bias, which this model.py does not implement"])


def test_load_pretrained_refuses_a_setting_it_does_not_apply(llama_copy):
    with pytest.raises(UserError, match="takes dropout and use_kernels"):
        load_pretrained(llama_copy, lora_rank=4)


def test_a_lora_checkpoint_whose_base_is_gone_says_where_to_put_it(tmp_path):
    from lib.resume import model_from_checkpoint
    args = {**GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32).__dict__, "lora_rank": 4}
    checkpoint = {"model_args": args, "model": {}, "pretrained": str(tmp_path / "gone"), "base_fingerprint": "0" * 16}
    with pytest.raises(UserError, match=f"the base model this LoRA run began from is not at {tmp_path / 'gone'}"):
        model_from_checkpoint(checkpoint)


def lora_checkpoint(tmp_path, targets="q,k,v,o,gate,up,down"):
    # a LoRA run's checkpoint built in process: a base folder, its fingerprint, adapters with values of their own
    from dataclasses import asdict
    from lib.hf import fingerprint
    from lib.lora import add_lora
    torch.manual_seed(0)
    save_pretrained(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)), tmp_path / "base")
    model = add_lora(load_pretrained(tmp_path / "base"), 4, 8.0, 0.0, targets)
    adapters = {n: torch.randn_like(t) for n, t in model.state_dict().items() if ".lora." in n}
    return {"model_args": asdict(model.config), "model": adapters, "pretrained": str(tmp_path / "base"),
            "base_fingerprint": fingerprint(tmp_path / "base")}


def test_a_bases_fingerprint_reads_a_bounded_header_whatever_the_file_claims(tmp_path, monkeypatch):
    # the 8 bytes before a safetensors header say its length: one that claims 2**62 had the whole file read into
    # memory (a sparse file of any size; a MemoryError's traceback past the memory), before load_pretrained refused it
    import builtins
    import lib.hf
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write((2**62).to_bytes(8, "little"))
        f.truncate(1 << 20)
    reads, real_open = [], builtins.open

    class Counted:  # the file, each read's size noted
        def __init__(self, *args, **kwargs):
            self.file = real_open(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def read(self, n=-1):
            reads.append(n)
            return self.file.read(n)
    monkeypatch.setattr(lib.hf, "MAX_HEADER", 1000)
    monkeypatch.setattr(lib.hf, "open", Counted, raising=False)
    assert len(lib.hf.fingerprint(tmp_path)) == 16 and max(reads) == 1 << 16  # the 64 KB samples, the header 1000


def test_a_lora_checkpoint_loads_only_its_own_adapters(tmp_path):
    from lib.resume import model_from_checkpoint
    checkpoint = lora_checkpoint(tmp_path)
    model = model_from_checkpoint(checkpoint)
    state = model.state_dict()
    assert all(torch.equal(state[n], t) for n, t in checkpoint["model"].items())
    # adapters of targets the run's model_args do not name: left over
    with pytest.raises(UserError, match="does not hold this model's adapters"):
        model_from_checkpoint({**checkpoint, "model_args": {**checkpoint["model_args"], "lora_targets": "q,v"}})
    # one adapter missing: it would start at zero, not as trained
    missing = {n: t for n, t in checkpoint["model"].items() if "blocks.0.attn.q." not in n}
    with pytest.raises(UserError, match="does not hold this model's adapters"):
        model_from_checkpoint({**checkpoint, "model": missing})


def test_a_lora_base_whose_config_json_changed_is_another_base(tmp_path):
    from lib.resume import model_from_checkpoint
    checkpoint = lora_checkpoint(tmp_path)
    config = read_config(tmp_path / "base")
    write_config(tmp_path / "base", {**config, "rms_norm_eps": 1e-2})  # the same weights, another model
    with pytest.raises(UserError, match="is not the one this LoRA run began from"):
        model_from_checkpoint(checkpoint)


def test_a_lora_checkpoint_takes_the_base_dtype_and_run_settings_given(tmp_path):
    from lib.resume import model_from_checkpoint
    checkpoint = lora_checkpoint(tmp_path)
    checkpoint["model_args"] = {**checkpoint["model_args"], "use_kernels": True}
    model = model_from_checkpoint(checkpoint, torch.bfloat16, dropout=0.25)
    assert model.config.dropout == 0.25 and model.config.use_kernels is True
    assert model.blocks[0].attn.q.weight.dtype == torch.bfloat16  # the frozen base as the run held it
    assert {p.dtype for n, p in model.named_parameters() if ".lora." in n} == {torch.float32}


def test_a_checkpoint_takes_the_run_settings_given():
    from dataclasses import asdict
    from lib.resume import model_from_checkpoint
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    checkpoint = {"model_args": asdict(model.config), "model": model.state_dict()}
    assert model_from_checkpoint(checkpoint, dropout=0.25).config.dropout == 0.25


def test_a_lora_base_whose_weights_alone_changed_is_another_base(tmp_path):
    # the same config.json and safetensors header, one weight's value changed in place
    import struct
    from lib.resume import model_from_checkpoint
    checkpoint = lora_checkpoint(tmp_path)
    with open(tmp_path / "base" / "model.safetensors", "r+b") as f:
        f.seek(-4, 2)
        value = struct.unpack("<f", f.read(4))[0]
        f.seek(-4, 2)
        f.write(struct.pack("<f", value * 1.01 + 0.1))
    with pytest.raises(UserError, match="is not the one this LoRA run began from"):
        model_from_checkpoint(checkpoint)
