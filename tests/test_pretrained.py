"""
Hugging Face folders in and out: GPT.from_pretrained and GPT.save_pretrained, judged by transformers.

    python -m pytest tests/test_pretrained.py -q

Nothing is downloaded: every test builds tiny random models of each family with transformers' own config
classes, saves them, and compares logits (and greedy tokens) between transformers and our GPT. Weights are
re-drawn large (std 0.2, norms around one, biases non-zero) because transformers' init gives logits near
zero, where a dropped norm or a swapped weight would hardly show.
"""

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402 (after the skip: safetensors comes with transformers)
from safetensors.torch import load_file, save_file  # noqa: E402

from lib.files import UserError
from lib.hf import load_pretrained, save_pretrained
from model import GPT, GPTConfig  # noqa: E402

AutoModelForCausalLM = transformers.AutoModelForCausalLM

# --- tiny families --------------------------------------------------------------------------------------

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
# Llama 3.1's scaling, with original_max_position_embeddings cut to 32 so that it moves the frequencies
# of a head of 16: one wavelength stays (< 32/4), one is blended, the rest are divided by 8.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Each family differs from our defaults (rope_theta 10000, norm_eps 1e-5, untied) somewhere, so that
# a reader that ignores a field of config.json shows up as different logits.
FAMILIES = {
    "llama3": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5)),
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                  rms_norm_eps=1e-4)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "mistral": ("MistralConfig", dict(sliding_window=None, rms_norm_eps=1e-5,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # a sliding window no shorter than the sequences used: the model is exact on them
    "mistral_window": ("MistralConfig", dict(sliding_window=64, rms_norm_eps=1e-5)),
    # Qwen2 has biases on q, k and v; its small sizes (Qwen2.5-0.5B) tie the embeddings
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True, rms_norm_eps=1e-6,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # Qwen3 normalises q and k per head, and its head_dim (32) is not hidden_size / heads (16); an eps near the
    # hidden states' mean square, where each norm that left it out would show
    "qwen3": ("Qwen3Config", dict(head_dim=32, rms_norm_eps=0.5,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}
MODEL_TYPES = {"LlamaConfig": "llama", "MistralConfig": "mistral", "Qwen2Config": "qwen2",
               "Qwen3Config": "qwen3"}


def randomize(model, seed=0):
    # large random weights: norms' weights around one (a swapped or dropped norm changes the logits),
    # everything else, biases included, std 0.2
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if p.dim() == 1 and "norm" in name else 0.2 * noise)
    return model


def build_hf(family, seed=0):
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(config), seed).eval()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    # family -> (folder transformers saved in fp32, the transformers model); each built once per module
    built = {}

    def get(family):
        if family not in built:
            hf = build_hf(family)
            folder = tmp_path_factory.mktemp(family)
            hf.save_pretrained(folder)
            built[family] = folder, hf
        return built[family]
    return get


def random_ids(vocab_size=SHAPE["vocab_size"], shape=(2, 20), seed=1):
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(hf, ids):
    return hf.eval()(ids).logits.float()


@torch.no_grad()
def our_logits(model, ids):
    logits, _ = model.eval()(ids)
    return logits.float()


def assert_same_logits(ours, theirs):
    # fp32 on both sides: sums taken in another order differ by ~1e-6 of the logits' scale
    assert ours.shape == theirs.shape
    scale = theirs.abs().max().item()
    assert scale > 1.0, f"logits up to {scale:.3g} only: too small to tell two models apart"
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4 * scale, f"max abs diff {diff:.3g} with logits up to {scale:.3g}"


def hf_load(path, **kw):
    # transformers' load, which must find exactly its own tensor names, of the right shapes
    hf, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kw)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"transformers loaded {path} with {problems}"
    return hf.eval()


def read_config(folder):
    return json.loads((folder / "config.json").read_text())


def write_config(folder, config):
    (folder / "config.json").write_text(json.dumps(config, indent=2))


# --- 1. logits both ways, every family ---------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_logits_both_ways(family, hf_folder, tmp_path):
    folder, hf = hf_folder(family)
    ids = random_ids()
    expected = hf_logits(hf, ids)
    ours = load_pretrained(folder)
    assert all(p.dtype == torch.float32 for p in ours.parameters())
    assert_same_logits(our_logits(ours, ids), expected)

    save_pretrained(ours, tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    config = read_config(tmp_path)
    assert config["model_type"] == hf.config.model_type == MODEL_TYPES[FAMILIES[family][0]]
    assert config["architectures"] == hf.config.architectures
    back = hf_load(tmp_path)
    assert type(back) is type(hf)
    assert_same_logits(hf_logits(back, ids), expected)


def test_llama3_scaling_moves_some_frequencies(hf_folder):
    # guards the llama3 case above: its scaling must really change frequencies of this tiny head,
    # some of them (fully or blended) and not others, or the test could not tell scaled from plain
    _, hf = hf_folder("llama3")
    head_size = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    plain = 1.0 / LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, head_size, 2).float() / head_size)
    scaled = hf.model.rotary_emb.inv_freq.float()
    same = torch.isclose(scaled, plain)
    divided = torch.isclose(scaled, plain / LLAMA3_ROPE["factor"])
    assert same.any() and divided.any() and (~same & ~divided).any(), (plain, scaled)


def test_default_and_asked_block_size(hf_folder):
    folder, _ = hf_folder("llama")
    assert load_pretrained(folder).config.block_size == SHAPE["max_position_embeddings"]
    # a Mistral sliding window shorter than max_position_embeddings bounds the default
    window_folder, window_hf = hf_folder("mistral_window")
    assert load_pretrained(window_folder).config.block_size == 64
    # a shorter block_size asked is only checked against that limit (main's 57449bb keeps config.block_size
    # at the model's own limit, so that a saved folder keeps its max_position_embeddings)
    ours = load_pretrained(window_folder, block_size=32)
    ids = random_ids()
    assert_same_logits(our_logits(ours, ids), hf_logits(window_hf, ids))


# --- 2. greedy generation -----------------------------------------------------------------------------------

# One cache and sampling path serves every family (test_logits_both_ways checks each family's forward): the quick
# tier keeps Qwen3 (q/k norms, a head_dim of its own), the slow tier the other two.
@pytest.mark.parametrize("family", [pytest.param("llama3", marks=pytest.mark.slow), "qwen3",
                                    pytest.param("qwen2", marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(family, hf_folder):
    folder, hf = hf_folder(family)
    ids = random_ids()
    # no end-of-sequence id, so that transformers never stops early or pads
    generation_config = copy.deepcopy(hf.generation_config)
    generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=generation_config,
                               max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert expected.shape == (2, 30)
    assert len(set(expected[:, 20:].flatten().tolist())) > 2  # a real continuation, not one repeated token
    got = load_pretrained(folder).eval().generate(ids, 10, temperature=0)
    assert torch.equal(got, expected), (got, expected)


# --- 3. sharded folders -------------------------------------------------------------------------------------

def shard_files(folder):
    return sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))


def test_loads_sharded_folder(hf_folder, tmp_path):
    _, hf = hf_folder("qwen3")
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(shard_files(tmp_path)) > 1
    assert not (tmp_path / "model.safetensors").exists()
    ids = random_ids()
    assert_same_logits(our_logits(load_pretrained(tmp_path), ids), hf_logits(hf, ids))


def test_loads_a_hugging_face_cache_snapshot_of_shards(hf_folder, tmp_path):
    # hf download's layout: hub/models--ORG--NAME/snapshots/REVISION/NAME, each a link to ../../blobs/HASH
    _, hf = hf_folder("qwen3")
    hf.save_pretrained(tmp_path / "saved", max_shard_size="50KB")
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    for i, file in enumerate(sorted((tmp_path / "saved").iterdir())):
        file.rename(repo / "blobs" / f"hash{i}")
        (repo / "snapshots" / "abc123" / file.name).symlink_to(f"../../blobs/hash{i}")
    ids = random_ids()
    assert_same_logits(our_logits(load_pretrained(repo / "snapshots" / "abc123"), ids), hf_logits(hf, ids))
    # a link of any other folder out of it is still refused
    (tmp_path / "elsewhere").mkdir()
    os.rename(repo / "blobs" / "hash1", tmp_path / "elsewhere" / "shard")
    shard = repo / "snapshots" / "abc123" / shard_files(repo / "snapshots" / "abc123")[0]
    shard.unlink()
    shard.symlink_to(tmp_path / "elsewhere" / "shard")
    with pytest.raises(UserError, match="which is outside"):
        load_pretrained(repo / "snapshots" / "abc123")


def test_saves_sharded_folder(hf_folder, tmp_path):
    folder, hf = hf_folder("qwen3")
    save_pretrained(load_pretrained(folder), tmp_path, max_shard_bytes=50_000)
    shards = shard_files(tmp_path)
    assert len(shards) > 1 and not (tmp_path / "model.safetensors").exists()
    assert all(name == f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, name in enumerate(shards, 1))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    # the index names every tensor's shard, truly; a shard past the limit holds a single tensor
    held = {}
    for name in shards:
        with safe_open(tmp_path / name, "pt") as f:
            keys = list(f.keys())
            held.update({k: name for k in keys})
            size = sum(f.get_tensor(k).nbytes for k in keys)
        assert size <= 50_000 or len(keys) == 1, f"{name}: {size} bytes in {len(keys)} tensors"
    assert index["weight_map"] == held
    ids = random_ids()
    assert_same_logits(hf_logits(hf_load(tmp_path), ids), hf_logits(hf, ids))


def test_max_shard_bytes_is_the_second_parameter(hf_folder, tmp_path):
    # save_pretrained(path, max_shard_bytes=...): a size given in second place shards, and is not taken
    # for some other field of config.json
    folder, _ = hf_folder("qwen3")
    save_pretrained(load_pretrained(folder), tmp_path, 50_000)
    assert len(shard_files(tmp_path)) > 1
    assert 50_000 not in read_config(tmp_path).values()


# --- 4. config.json as the Hub's released models hold it ----------------------------------------------------

def test_transformers_writes_rope_parameters(hf_folder):
    # what transformers 5 writes: rope_theta inside rope_parameters, nothing at the top level; the
    # Hub-style test below covers the other shape
    config = read_config(hf_folder("llama3")[0])
    assert config["rope_parameters"] == LLAMA3_ROPE
    assert "rope_theta" not in config and "rope_scaling" not in config and config["dtype"] == "float32"
    plain = read_config(hf_folder("llama")[0])["rope_parameters"]
    assert plain == {"rope_type": "default", "rope_theta": 500000.0}


def hub_style(config):
    # rope_theta and rope_scaling at the top level (null without scaling), torch_dtype for dtype: the shape
    # of Llama-3.2's, Mistral-7B's or Qwen2.5's config.json
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype")
    return config


@pytest.mark.parametrize("family", ["llama3", "llama", "mistral_window", "qwen2", "qwen3"])
def test_hub_style_config(family, hf_folder, tmp_path):
    folder, hf = hf_folder(family)
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = hub_style(read_config(folder))
    if family == "llama":
        del config["head_dim"]  # Llama 2's config.json has none: hidden_size / num_attention_heads
    if family == "qwen2":  # as Qwen2.5's: a window given, switched off
        config.update(sliding_window=SHAPE["max_position_embeddings"], use_sliding_window=False)
    write_config(tmp_path, config)
    ids = random_ids()
    expected = hf_logits(hf, ids)
    # transformers reads the rewritten file as the same model: the rewrite kept its meaning
    assert_same_logits(hf_logits(hf_load(tmp_path), ids), expected)
    assert_same_logits(our_logits(load_pretrained(tmp_path), ids), expected)


# --- 5. refusals: one line, naming what is not supported or wrong -------------------------------------------

def assert_refused(folder, words, **kw):
    with pytest.raises(ValueError) as e:
        load_pretrained(folder, **kw)
    message = str(e.value)
    assert message.strip() and "\n" not in message.strip(), f"not one line: {message!r}"
    assert any(w in message for w in words), f"{message!r} names none of {words}"


@pytest.fixture
def llama_copy(hf_folder, tmp_path):
    folder = tmp_path / "llama"
    shutil.copytree(hf_folder("llama")[0], folder)
    return folder


def test_swish_is_silu(llama_copy):
    ids, silu = random_ids(), load_pretrained(llama_copy)
    write_config(llama_copy, {**read_config(llama_copy), "hidden_act": "swish"})  # transformers' ACT2FN: nn.SiLU
    assert torch.equal(our_logits(load_pretrained(llama_copy), ids), our_logits(silu, ids))
    write_config(llama_copy, {**read_config(llama_copy), "hidden_act": "gelu"})
    assert_refused(llama_copy, ["hidden_act 'gelu' is not supported"])


def test_refuses_a_number_past_a_floats_range(llama_copy):
    # JSON's integers have no bound: 10**400 as rope_theta, or as llama3's factor, is one line, not an OverflowError
    config = read_config(llama_copy)
    write_config(llama_copy, {**hub_style(config), "rope_theta": 10**400})
    assert_refused(llama_copy, ["rope_theta=1000"])
    write_config(llama_copy, {**hub_style(config), "rope_scaling": {**LLAMA3_ROPE, "factor": 10**400}})
    assert_refused(llama_copy, ["must hold numbers above 0"])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_bias_setting_is_refused_where_transformers_builds_its_biases(family, hf_folder, tmp_path):
    # attention_bias and mlp_bias, as transformers reads them: a model with biases ours lacks is refused, a setting
    # transformers does not read for this family (Mistral's, Qwen2's fixed biases) leaves the same model
    folder, original = tmp_path / family, hf_folder(family)[1]
    shutil.copytree(hf_folder(family)[0], folder)
    config, ids = read_config(folder), random_ids()
    plain = our_logits(load_pretrained(folder), ids)
    for key in ("attention_bias", "mlp_bias"):
        write_config(folder, {**config, key: True})
        built = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(folder))
        if set(built.state_dict()) - set(original.state_dict()):
            assert_refused(folder, ["(attention_bias/mlp_bias) are not supported"])
        else:
            assert torch.equal(our_logits(load_pretrained(folder), ids), plain)


def test_refuses_a_quantized_release(llama_copy):
    write_config(llama_copy, {**read_config(llama_copy), "quantization_config": {"quant_method": "fp8"}})
    assert_refused(llama_copy, ["quantization_config (fp8): a quantized release"])


@pytest.mark.parametrize("model_type", ["gpt_neox", "gemma", "phi3", "gpt2"])
def test_refuses_other_model_types(model_type, llama_copy):
    write_config(llama_copy, {**read_config(llama_copy), "model_type": model_type})
    assert_refused(llama_copy, [model_type])


@pytest.mark.parametrize("where, rope", [
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
    ("rope_parameters", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ("rope_scaling", {"type": "linear", "factor": 2.0}),  # the older key, as Llama 2 era files have it
])
def test_refuses_other_rope_scaling(where, rope, llama_copy):
    config = read_config(llama_copy)
    if where == "rope_scaling":
        config = {**hub_style(config), "rope_scaling": rope}
    else:
        config["rope_parameters"] = rope
    write_config(llama_copy, config)
    kind = rope.get("rope_type", rope.get("type"))
    assert_refused(llama_copy, [kind])


def test_rope_scaling_beside_rope_parameters_is_read_as_transformers_reads_it(llama_copy):
    # rope_scaling added to a file transformers 5 wrote (rope_parameters): transformers takes rope_scaling whole, with
    # the top-level rope_theta, and leaves rope_parameters unread, so must we
    config = read_config(llama_copy)
    write_config(llama_copy, {**config, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert_refused(llama_copy, ["linear"])
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    write_config(llama_copy, {**config, "rope_scaling": scaling, "rope_theta": 500000.0})
    ids = random_ids()
    assert_same_logits(our_logits(load_pretrained(llama_copy), ids), hf_logits(hf_load(llama_copy), ids))


def test_refuses_sliding_window_shorter_than_block_size(hf_folder, tmp_path):
    shutil.copytree(hf_folder("mistral_window")[0], tmp_path, dirs_exist_ok=True)
    write_config(tmp_path, {**read_config(tmp_path), "sliding_window": 16})
    assert_refused(tmp_path, ["sliding_window", "sliding window"], block_size=64)
    # a Mistral config.json without the key attends within transformers' default 4,096 tokens, as transformers does
    config = {**read_config(tmp_path), "max_position_embeddings": 8192}
    del config["sliding_window"]
    write_config(tmp_path, config)
    assert_refused(tmp_path, ["sliding_window of 4096"], block_size=4100)
    assert load_pretrained(tmp_path).config.block_size == 4096


def test_a_qwen_sliding_window_switched_on_without_its_size_is_transformers_default(hf_folder, tmp_path):
    # use_sliding_window without sliding_window: Qwen2Config's and Qwen3Config's default 4,096 tokens, not none
    shutil.copytree(hf_folder("qwen2")[0], tmp_path, dirs_exist_ok=True)
    config = {**read_config(tmp_path), "max_position_embeddings": 8192, "use_sliding_window": True,
              "max_window_layers": 0}
    config.pop("sliding_window", None)
    write_config(tmp_path, config)
    assert_refused(tmp_path, ["sliding_window of 4096"], block_size=4100)
    assert load_pretrained(tmp_path).config.block_size == 4096


def test_a_tied_model_whose_file_holds_another_head_is_refused(hf_folder, tmp_path):
    # tie_word_embeddings with an lm_head.weight unlike the embedding: transformers 5 unties them and computes with
    # it, transformers 4 and vLLM drop it. The same head stored twice loads
    shutil.copytree(hf_folder("llama_tied")[0], tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids = random_ids()
    assert_same_logits(our_logits(load_pretrained(tmp_path), ids), hf_logits(hf_folder("llama_tied")[1], ids))
    head = weights["model.embed_tokens.weight"] + 0.1
    save_file({**weights, "lm_head.weight": head}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_refused(tmp_path, ["tie_word_embeddings"])


def test_refuses_missing_tensor(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    assert_refused(llama_copy, ["layers.1.self_attn.k_proj"])


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.o_proj.weight", (64, 48)),
    ("model.layers.1.self_attn.q_proj.weight", (80, 64)),  # fused with k and v in ours: checked before
    ("model.norm.weight", (65,)),
])
def test_refuses_misshapen_tensor(name, shape, llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    weights[name] = torch.randn(shape)
    save_file(weights, llama_copy / "model.safetensors", metadata={"format": "pt"})
    assert_refused(llama_copy, [name.removeprefix("model.").removesuffix(".weight")])


def test_refuses_block_size_past_max_positions(llama_copy):
    assert_refused(llama_copy, ["block_size", "max_position_embeddings"],
                   block_size=SHAPE["max_position_embeddings"] + 1)


def test_refuses_folder_without_config(llama_copy):
    (llama_copy / "config.json").unlink()
    assert_refused(llama_copy, ["config.json"])


def test_refuses_folder_without_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    assert_refused(llama_copy, ["safetensors"])


# Damaged files are a user's mistake too (DESIGN.md: a corrupt file ends in one line naming the problem),
# not a KeyError or a safetensors traceback.

@pytest.mark.parametrize("field", ["hidden_size", "num_attention_heads"])
def test_refuses_config_without_a_needed_field(field, llama_copy):
    config = read_config(llama_copy)
    del config[field]
    write_config(llama_copy, config)
    assert_refused(llama_copy, [field])


def test_refuses_llama3_scaling_without_its_factors(llama_copy):
    config = read_config(llama_copy)
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}
    write_config(llama_copy, config)
    assert_refused(llama_copy, ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"])


def test_refuses_truncated_safetensors(llama_copy):
    weights = llama_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    assert_refused(llama_copy, ["model.safetensors"])


# --- 6. dtype ---------------------------------------------------------------------------------------------

def test_bfloat16_in_and_out(tmp_path):
    hf = build_hf("llama3").to(torch.bfloat16)
    folder = tmp_path / "bf16"
    hf.save_pretrained(folder)
    ours = load_pretrained(folder)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    ours32 = load_pretrained(folder, dtype=torch.float32)
    assert {p.dtype for p in ours32.parameters()} == {torch.float32}
    # the same bf16 weights, widened on both sides
    ids = random_ids()
    expected = hf_logits(hf_load(folder, dtype=torch.float32), ids)
    assert_same_logits(our_logits(ours32, ids), expected)

    out = tmp_path / "out"
    save_pretrained(ours, out)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert hf_load(out, dtype="auto").dtype == torch.bfloat16
    # bf16 to bf16 and back loses nothing
    assert_same_logits(hf_logits(hf_load(out, dtype=torch.float32), ids), expected)


# --- 7. a model trained here goes out as Llama ------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_scratch_model_loads_as_llama(tied, tmp_path):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=320, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                       tie_embeddings=tied, rope_theta=500000.0, norm_eps=1e-4, use_kernels=False)
    model = randomize(GPT(config)).eval()
    save_pretrained(model, tmp_path)
    saved = read_config(tmp_path)
    assert saved["model_type"] == "llama" and saved["architectures"] == ["LlamaForCausalLM"]
    hf = hf_load(tmp_path)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert hf.config.tie_word_embeddings == tied
    ids = random_ids()
    expected = our_logits(model, ids)
    assert_same_logits(hf_logits(hf, ids), expected)
    # and back into ours
    assert_same_logits(our_logits(load_pretrained(tmp_path), ids), expected)


@pytest.mark.parametrize("shape", [dict(qk_norm=True), dict(qkv_bias=True), dict(family="qwen3"),
                                   dict(family="mistral", qk_norm=True)])
def test_an_attention_its_family_does_not_have_is_refused_by_the_export(tmp_path, shape):
    # config.json says q and k norms only as Qwen3, q, k and v biases only as Qwen2: a scratch run's qk_norm=True
    # under family 'llama' would go out as a Llama whose norms transformers drops (its logits off by as much as they
    # are); a 'qwen3' without the norms as one transformers gives norms of ones. Refused in one line, nothing written
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, **shape))
    with pytest.raises(UserError, match="config.json says (qk_norm|qkv_bias) only by naming"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_a_model_setting_config_json_cannot_say_is_refused_by_the_export(tmp_path):
    # a field added to GPTConfig (here by a subclass, as an edit of model.py would add it) and set otherwise than
    # its default has no place in config.json: the export says so in one line instead of writing another model
    @dataclasses.dataclass
    class Edited(GPTConfig):
        attention_window: int = 0

    model = GPT(Edited(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, attention_window=8))
    with pytest.raises(UserError, match="attention_window=8 has no Hugging Face config.json field"):
        save_pretrained(model, tmp_path / "windowed")
    assert not (tmp_path / "windowed" / "config.json").exists()
    model.config.attention_window = 0  # its default: the model is the one config.json says
    save_pretrained(model, tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["num_hidden_layers"] == 1


def test_a_parameter_model_py_adds_or_leaves_out_is_refused_where_a_folder_has_no_place_for_it(tmp_path, monkeypatch):
    # an edit of model.py that adds a parameter (a learned scale per block): started from a folder it would hold
    # whatever memory held (an inf loss at every step, or garbage that trains on), and an export would leave it out
    # (transformers would run another model); with the gate left out (an MLP of two matrices), the folder's has
    # nowhere to go. Each is said in one line, before a weight is read or a file written
    import model as model_py
    shape = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)
    save_pretrained(GPT(GPTConfig(**shape)), tmp_path / "folder")
    block_init, mlp_init = model_py.Block.__init__, model_py.MLP.__init__

    def scaled(self, *args, **kwargs):
        block_init(self, *args, **kwargs)
        self.res_scale = torch.nn.Parameter(torch.ones(1))

    def ungated(self, *args, **kwargs):
        mlp_init(self, *args, **kwargs)
        del self.gate

    monkeypatch.setattr(model_py.Block, "__init__", scaled)
    with pytest.raises(UserError, match=r"this model.py's blocks.0.res_scale has no place in \S+folder's weights: "
                                        r"train an edited model.py from scratch"):
        load_pretrained(tmp_path / "folder")
    with pytest.raises(UserError, match=r"this model.py's blocks.0.res_scale has no place in a Hugging Face folder: "
                                        r"transformers, vLLM and llama.cpp would run another model"):
        save_pretrained(GPT(GPTConfig(**shape)), tmp_path / "scaled")
    monkeypatch.setattr(model_py.Block, "__init__", block_init)
    monkeypatch.setattr(model_py.MLP, "__init__", ungated)
    with pytest.raises(UserError, match=r"folder's weights would fill blocks.0.mlp.gate.weight, which this model.py "
                                        r"does not have"):
        load_pretrained(tmp_path / "folder")
    with pytest.raises(UserError, match="a Hugging Face folder would fill blocks.0.mlp.gate.weight, which this "):
        save_pretrained(GPT(GPTConfig(**shape)), tmp_path / "ungated")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # nothing written
