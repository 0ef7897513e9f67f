"""export.py --to=NAME.gguf: one GGUF file, read back with the gguf package's own reader, holds every
weight of the run in the layout llama.cpp wants, the hyperparameters it reads and the dataset's tokenizer.
And the special tokens of both exports: as prepare.py made the data, or as an imported base has them.
Run: python -m pytest -q tests/test_gguf.py"""

import json
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

import export
from helpers import TINY, run, script
from lib.files import UserError
from lib.gguf_export import PRE_TOKENIZERS, interleave_rotary, vocabulary
from lib.hf import hf_layout
from lib.tokenizer import load_tokenizer, make_tokenizer
from lib.tokenizer_json import byte_chars

gguf = pytest.importorskip("gguf")


def write_run(folder):
    # bpe:300 learned by prepare.py on some Python source, and a tiny GQA model trained on it for 3 steps
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))
    (folder / "corpus.txt").write_text("\n".join(f.read_text(errors="replace") for f in files)[:150_000])
    done = script("prepare.py", folder / "corpus.txt", "--tokenizer=bpe:300", f"--out_dir={folder / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*TINY, f"--data_dir={folder / 'data'}", f"--out_dir={folder / 'run'}", "--max_iters=3")


@pytest.fixture(scope="module")
def bpe_run(shared):
    return shared("gguf-bpe-run", write_run)


def exported(folder, tmp_path, *args):
    path = tmp_path / "model.gguf"
    done = script("export.py", f"--out_dir={folder / 'run'}", f"--to={path}", *args)
    assert done.returncode == 0, done.stderr
    return gguf.GGUFReader(path)


def run_model(folder):
    from lib.resume import load_checkpoint, model_from_checkpoint
    return model_from_checkpoint(load_checkpoint(folder / "run" / "ckpt.pt"))


def value(reader, key):
    return reader.fields[key].contents()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_every_tensor_is_the_models_in_llama_cpps_layout(bpe_run, tmp_path, dtype):
    reader = exported(bpe_run, tmp_path, f"--dtype={dtype}")
    file_types = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                  "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}
    assert value(reader, "general.file_type") == file_types[dtype]  # what llama.cpp says the file holds
    model = run_model(bpe_run)
    config, params = model.config, dict(model.named_parameters())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.n_layer)
    tensors = {t.name: t for t in reader.tensors}
    layout = hf_layout(config)
    assert len(tensors) == len(layout) and "output.weight" not in tensors  # the head is tied: not written
    for hf_name, ours in layout.items():
        stored = tensors[names.get_name(hf_name, try_suffixes=(".weight",))]
        expected = params[ours].detach()
        if expected.dim() == 2:  # norms stay float32; the matrices take the dtype asked for
            expected = expected.to(getattr(torch, dtype))
        if stored.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = torch.from_numpy(np.array(stored.data).view(np.int16)).view(torch.bfloat16)
        else:
            data = torch.from_numpy(np.array(stored.data))
        data = data.reshape(expected.shape)
        for proj, heads in (("q_proj", config.n_head), ("k_proj", config.n_kv_head)):
            if proj in hf_name:  # llama.cpp's llama rotates interleaved pairs: undo the reordering to compare
                assert not torch.equal(data, expected)
                data = uninterleave(data, heads)
        assert data.dtype == expected.dtype and torch.equal(data, expected), hf_name


def uninterleave(weight, heads):
    # the inverse of gguf_export.interleave_rotary, written the other way round: alternating rows -> halves
    rows = weight.reshape(heads, -1, 2, weight.shape[-1])
    return torch.cat([rows[:, :, 0], rows[:, :, 1]], dim=1).reshape(weight.shape)


def test_interleave_pairs_each_heads_halves():
    weight = torch.arange(2 * 8, dtype=torch.float32)[:, None]  # two heads of 8 rows
    out = interleave_rotary(weight, 2)[:, 0].tolist()
    assert out == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(uninterleave(interleave_rotary(weight, 2), 2), weight)


def test_metadata_and_tokenizer(bpe_run, tmp_path):
    reader = exported(bpe_run, tmp_path)
    config = run_model(bpe_run).config
    tokenizer = load_tokenizer(bpe_run / "data")
    assert value(reader, "general.architecture") == "llama"
    expected = {"block_count": config.n_layer, "attention.head_count": config.n_head,
                "attention.head_count_kv": config.n_kv_head, "context_length": config.block_size,
                "embedding_length": config.n_embd, "feed_forward_length": config.mlp_hidden,
                "rope.freq_base": config.rope_theta, "vocab_size": config.vocab_size,
                "rope.dimension_count": config.head_size, "attention.key_length": config.head_size,
                "attention.value_length": config.head_size}
    for key, wanted in expected.items():
        assert value(reader, f"llama.{key}") == wanted, key
    assert value(reader, "llama.attention.layer_norm_rms_epsilon") == pytest.approx(config.norm_eps)
    assert value(reader, "tokenizer.ggml.model") == "gpt2"  # llama.cpp's name for a byte-level BPE
    assert value(reader, "tokenizer.ggml.pre") == "llama-bpe"
    assert value(reader, "tokenizer.ggml.eos_token_id") == tokenizer.eot_id
    assert "tokenizer.ggml.bos_token_id" not in reader.fields  # our documents have no start token
    assert value(reader, "tokenizer.ggml.add_bos_token") is False
    assert value(reader, "tokenizer.ggml.add_eos_token") is False  # (else llama.cpp ends every prompt with one)
    assert "tokenizer.chat_template" not in reader.fields
    # every token's text is its bytes, spelled as byte-level BPE files spell them; the padding is unused
    tokens, types = value(reader, "tokenizer.ggml.tokens"), value(reader, "tokenizer.ggml.token_type")
    assert len(tokens) == config.vocab_size
    byte_of = {c: b for b, c in byte_chars().items()}
    for i in range(tokenizer.eot_id):
        assert bytes(byte_of[c] for c in tokens[i]) == tokenizer.enc.decode_single_token_bytes(i)
        assert types[i] == gguf.TokenType.NORMAL
    assert tokens[tokenizer.eot_id] == "<|endoftext|>" and types[tokenizer.eot_id] == gguf.TokenType.CONTROL
    assert set(types[tokenizer.eot_id + 1:]) == {gguf.TokenType.UNUSED}
    merges = value(reader, "tokenizer.ggml.merges")
    assert len(merges) == tokenizer.eot_id - 256
    # in order of priority: merge i makes token 256 + i, which a BPE trained merge by merge numbers so
    assert all("".join(merge.split(" ")) == tokens[256 + i] for i, merge in enumerate(merges))


def test_overwrite_and_adapter(bpe_run, tmp_path):
    exported(bpe_run, tmp_path)
    again = script("export.py", f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / 'model.gguf'}")
    assert again.returncode != 0 and "pass --overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    (tmp_path / "model.gguf.export-tmp").write_text("mine")  # a name beside it is the user's, kept
    exported(bpe_run, tmp_path, "--overwrite", "--dtype=float16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "model.gguf.export-tmp"]  # nothing else
    assert (tmp_path / "model.gguf.export-tmp").read_text() == "mine"
    mask = os.umask(0)
    os.umask(mask)
    assert ((tmp_path / "model.gguf").stat().st_mode & 0o777) == 0o666 & ~mask  # not tempfile's 0600
    done = script("export.py", f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / 'upper.GGUF'}")
    assert done.returncode == 0 and gguf.GGUFReader(tmp_path / "upper.GGUF").fields  # a GGUF file, not a folder
    # a link (an Ollama Modelfile's current.gguf), dangling or not, is refused: replaced, it would stop being one
    for name, target in (("current.gguf", "model.gguf"), ("dangling.gguf", "gone.gguf")):
        (tmp_path / name).symlink_to(target)
        done = script("export.py", f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / name}", "--overwrite")
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and "is a link" in done.stderr, done.stderr
        assert (tmp_path / name).is_symlink()


@pytest.mark.slow  # tiktoken's three encodings, read whole
def test_every_tiktoken_pattern_has_llama_cpps_name(tmp_path):
    import tiktoken
    expected = {"gpt2": "gpt-2", "r50k_base": "gpt-2", "cl100k_base": "llama-bpe", "o200k_base": "gpt-4o"}
    for name, pre in expected.items():
        try:
            pattern = tiktoken.get_encoding(name)._pat_str
        except Exception as e:  # it would download: tests never do
            pytest.skip(f"tiktoken encoding {name} does not load offline ({type(e).__name__})")
        assert PRE_TOKENIZERS[pattern] == pre, name
    # llama.cpp's gpt-4o splits some text otherwise than o200k_base ("ÉS" as "É", "S"): written, and said
    from lib.gguf_export import write_gguf
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("o200k_base", None)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=8, block_size=8))
    said = write_gguf(model, tokenizer, tmp_path / "m.gguf", torch.float32, {"eos_token_id": tokenizer.eot_id})
    assert said.startswith("warning: llama.cpp's gpt-4o pre-tokenizer splits some text otherwise than o200k_base")
    bpe = make_tokenizer("bpe:260", lambda: iter(["hello world, hello there"] * 50))
    model = GPT(GPTConfig(vocab_size=320, n_layer=1, n_head=2, n_embd=8, block_size=8))
    assert write_gguf(model, bpe, tmp_path / "b.gguf", torch.float32, {"eos_token_id": bpe.eot_id}) is None


def test_a_chat_template_renders_in_gguf_as_its_data_was_whatever_bos_and_eos_llama_cpp_gives_it():
    # llama.cpp gives {{ bos_token }} its default (11: a comma in GPT-2's) where the file has no BOS; the template's
    # first line (a newline, spaces before a block) renders as it did, under trim_blocks and lstrip_blocks
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    import export
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    for template in ["\n{{ bos_token }}X{{ eos_token }}", "  {% if true %}X{% endif %}{{ eos_token }}",
                     "{%- if true %}\nY {{ bos_token }}{% endif %}"]:
        chat = {"template": template, "bos_token": "", "eos_token": '<|end "of" \\ tür|>'}
        data = env.from_string(template).render(bos_token="", eos_token=chat["eos_token"])
        assert env.from_string(export.gguf_template(chat)).render(bos_token=",", eos_token=",") == data, template


def test_char_tokenizer_is_refused_in_one_line():
    tokenizer = make_tokenizer("char", lambda: iter(["hello world"]))
    with pytest.raises(ValueError) as e:
        vocabulary(tokenizer, 64, gguf)
    # nor can llama.cpp's converter help: a character run's folder has no tokenizer to convert
    assert "\n" not in str(e.value) and str(e.value).endswith("prepare the data with --tokenizer=bpe:N and train on it")


def test_a_char_run_is_refused_in_one_line_and_leaves_no_file(tmp_path):
    (tmp_path / "corpus.txt").write_text("to be or not to be, that is the question\n" * 300)
    done = script("prepare.py", tmp_path / "corpus.txt", "--tokenizer=char", f"--out_dir={tmp_path / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    done = script("export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'model.gguf'}")
    assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("export.py: ") and "prepare the data with --tokenizer=bpe:N" in done.stderr
    assert not list(tmp_path.glob("model.gguf*"))


def test_without_the_gguf_package_one_line_says_to_install_it(bpe_run, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # an import of it fails as if it were not installed
    with pytest.raises(UserError) as e:  # printed as 'export.py: ' and this, in one line
        export.main([f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / 'model.gguf'}"])
    assert str(e.value) == "writing GGUF needs llama.cpp's gguf package: pip install gguf"
    assert not (tmp_path / "model.gguf").exists()


# -----------------------------------------------------------------------------
# a fine-tuned import: its base's special ids and generation defaults pass through to both exports

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
BASES = {  # family: (config class, split pattern, special tokens, ids in config.json)
    "llama": ("LlamaConfig", LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>"],
              dict(bos_token_id=0, eos_token_id=1, pad_token_id=1)),
    "qwen3": ("Qwen3Config", QWEN2_SPLIT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
              dict(bos_token_id=None, eos_token_id=2, pad_token_id=0)),
}


def make_base(folder, family, text):
    # a tiny random model of the family with a byte-level BPE split as its family's, as on the Hub
    import transformers
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    config_class, pattern, specials, ids = BASES[family]
    tok = Tokenizer(models.BPE())
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                 use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, **ids)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config = transformers.GenerationConfig(**ids, temperature=0.7, do_sample=True)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.slow  # a base, a dataset with its tokenizer and a short fine-tune
@pytest.mark.parametrize("family", [*BASES, "qwen3 without eos_token_id"])
def test_a_fine_tuned_import_keeps_its_bases_ids(family, tmp_path):
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[d-f]*.py"))
    text = "\n".join(f.read_text(errors="replace") for f in files)[:100_000]
    family, variant = family.split()[0], family != family.split()[0]
    make_base(tmp_path / "base", family, text)
    base = json.loads((tmp_path / "base" / "config.json").read_text())
    if variant:  # config.json without it (transformers 5 saves a Qwen3Config() so), tokenizer_config.json naming it:
        # llama.cpp, lacking one, would end texts at its default (11, a comma in a real Qwen vocabulary)
        (tmp_path / "base" / "config.json").write_text(json.dumps({**base, "eos_token_id": None}))
        (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (tmp_path / "corpus.txt").write_text(text)
    done = script("prepare.py", tmp_path / "corpus.txt", f"--tokenizer={tmp_path / 'base'}",
                  f"--out_dir={tmp_path / 'data'}")
    assert done.returncode == 0, done.stderr
    run("--block_size=32", "--batch_size=2", "--eval_iters=1", "--max_iters=2",
        f"--init_from={tmp_path / 'base'}", f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}")
    done = script("export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    ours = json.loads((tmp_path / "hf" / "config.json").read_text())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert ours.get(name) == base.get(name), name
    generation = (tmp_path / "hf" / "generation_config.json").read_text()
    assert generation == (tmp_path / "base" / "generation_config.json").read_text()
    reader = exported(tmp_path, tmp_path)
    assert value(reader, "general.architecture") == family
    assert value(reader, "tokenizer.ggml.pre") == {"llama": "llama-bpe", "qwen3": "qwen2"}[family]
    assert value(reader, "tokenizer.ggml.eos_token_id") == base["eos_token_id"]
    assert value(reader, "tokenizer.ggml.padding_token_id") == base["pad_token_id"]
    if base.get("bos_token_id") is not None:
        assert value(reader, "tokenizer.ggml.bos_token_id") == base["bos_token_id"]
    # Qwen rotates halves as model.py does: its q is written as it is
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    weight = dict(run_model(tmp_path).named_parameters())["blocks.0.attn.q.weight"].detach()
    written = torch.from_numpy(np.array(q.data)).reshape(weight.shape)
    assert torch.equal(written, weight) == (family == "qwen3")


# -----------------------------------------------------------------------------
# the Hugging Face folder of a run trained here: transformers encodes a text as prepare.py did

def write_gpt2_run(folder):
    (folder / "corpus.txt").write_text(Path(sysconfig.get_paths()["stdlib"], "abc.py").read_text() * 3)
    done = script("prepare.py", folder / "corpus.txt", "--tokenizer=gpt2", f"--out_dir={folder / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*TINY, f"--data_dir={folder / 'data'}", f"--out_dir={folder / 'run'}", "--max_iters=1")


@pytest.mark.parametrize("kind", ["bpe", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_autotokenizer_encodes_as_prepare_did(kind, bpe_run, shared, tmp_path):
    transformers = pytest.importorskip("transformers")
    if kind == "gpt2":
        tiktoken = pytest.importorskip("tiktoken")
        try:
            tiktoken.get_encoding("gpt2")
        except Exception as e:  # it would download: tests never do
            pytest.skip(f"tiktoken encoding gpt2 does not load offline ({type(e).__name__})")
    folder = bpe_run if kind == "bpe" else shared("gguf-gpt2-run", write_gpt2_run)
    done = script("export.py", f"--out_dir={folder / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is False and config["add_eos_token"] is False
    ids = np.fromfile(folder / "data" / "train.bin", dtype=np.uint16)[:3000].tolist()
    text = load_tokenizer(folder / "data").decode(ids)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    # nothing added in front; the last word, cut in the middle, may split otherwise
    assert auto(text)["input_ids"][:2900] == ids[:2900]
    eot = load_tokenizer(folder / "data").eot_id
    for name in ("config.json", "generation_config.json"):
        written = json.loads((tmp_path / "hf" / name).read_text())
        assert written["eos_token_id"] == written["pad_token_id"] == eot and "bos_token_id" not in written


def test_data_prepared_with_the_exports_tokenizer_is_the_runs_own(bpe_run, tmp_path):
    # prepare.py --tokenizer=EXPORT gives the run's ids: eval.py scores that folder as the run's own data (it refused
    # it: another tokenizer's fingerprint), and one prepared with the export's tokenizer.json less a merge still not
    done = script("export.py", f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    other = tmp_path / "other"
    other.mkdir()
    spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    spec["model"]["merges"] = spec["model"]["merges"][:-1]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    scores = {}
    for name, tokenizer in [("own", None), ("export", tmp_path / "hf"), ("other", other)]:
        data = bpe_run / "data" if tokenizer is None else tmp_path / f"data-{name}"
        if tokenizer is not None:
            done = script("prepare.py", bpe_run / "corpus.txt", f"--tokenizer={tokenizer}", f"--out_dir={data}")
            assert done.returncode == 0, done.stderr
        scores[name] = script("eval.py", f"--out_dir={bpe_run / 'run'}", f"--data_dir={data}", "--device=cpu")
    assert scores["export"].returncode == 0 and scores["export"].stdout == scores["own"].stdout.replace(
        str(bpe_run / "data"), str(tmp_path / "data-export")), scores["export"].stderr
    assert scores["other"].returncode == 1 and "was not prepared with the tokenizer" in scores["other"].stderr


def test_a_bpe_without_merges_is_refused_in_one_line():
    # bpe:256 is the bytes alone: gguf's writer left out the empty merges, and llama.cpp refuses a BPE without them
    tokenizer = make_tokenizer("bpe:256", lambda: iter(["hello world, hello there"] * 50))
    with pytest.raises(UserError, match=r"^this BPE tokenizer has no merges, and llama.cpp reads none without"):
        vocabulary(tokenizer, 320, gguf)
    four_merges = make_tokenizer("bpe:260", lambda: iter(["hello world, hello there"] * 50))
    assert len(vocabulary(four_merges, 320, gguf)[2]) == 4


def test_wordpiece_and_sentencepiece_style_tokenizers_are_refused():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    wordpiece = make_tokenizer("wordpiece:100", lambda: iter(["hello world, hello there"] * 50))
    spm = Tokenizer(models.BPE(vocab={"<unk>": 0, "▁": 1, "a": 2, "<|endoftext|>": 3}, merges=[], byte_fallback=True))
    spm.pre_tokenizer = pre_tokenizers.Metaspace()
    spm.decoder = decoders.Metaspace()
    from lib.tokenizer import hf_tokenizer
    for tokenizer in (wordpiece, hf_tokenizer("spm", spm.to_str())):
        with pytest.raises(ValueError) as e:
            vocabulary(tokenizer, 512, gguf)
        assert "\n" not in str(e.value) and "convert_hf_to_gguf.py" in str(e.value)


def test_a_qwen2_shape_keeps_its_biases_and_halves(tmp_path):
    from lib.gguf_export import write_gguf
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("bpe:260", lambda: iter(["hello world, hello there"] * 50))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, n_layer=1, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
                          qkv_bias=True, family="qwen2"))
    write_gguf(model, tokenizer, tmp_path / "m.gguf", torch.float32, {"eos_token_id": tokenizer.eot_id})
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    tensors = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert value(reader, "general.architecture") == "qwen2"
    for x in "qkv":
        written = tensors[f"blk.0.attn_{x}.bias"]
        assert torch.equal(written, getattr(model.blocks[0].attn, x).bias.detach()), x
    q = model.blocks[0].attn.q.weight.detach()
    assert torch.equal(tensors["blk.0.attn_q.weight"].reshape(q.shape), q)  # no reordering for Qwen


def test_a_gpt2_style_tokenizer_json_is_named_gpt2():
    # a tokenizer.json whose ByteLevel step splits on its own (GPT-2's, and the Hub's many copies of it)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from lib.tokenizer import hf_tokenizer
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello world, hello there"] * 50, trainer)
    hf.add_tokens(["<think>"])  # an added token that is not special, as Qwen3's: matched whole in text
    tokens, types, merges, pre = vocabulary(hf_tokenizer("gpt2-style", hf.to_str()), 320, gguf)
    assert pre == "gpt-2" and tokens[0] == "<|endoftext|>" and types[0] == gguf.TokenType.CONTROL
    think = hf.token_to_id("<think>")
    assert tokens[think] == "<think>" and types[think] == gguf.TokenType.USER_DEFINED
    assert len(merges) == hf.get_vocab_size() - 258  # one per token past the 256 bytes, <|endoftext|> and <think>
    vocab = hf.get_vocab()  # each merge is two tokens, a space between them, that make a third
    assert all(len(parts := merge.split(" ")) == 2 and {*parts, "".join(parts)} <= vocab.keys() for merge in merges)


# -----------------------------------------------------------------------------
# a tokenizer.json whose post-processor puts a BOS first (Llama 3's): the data, sample.py, the exported
# folder and the GGUF file all begin a text with it, as transformers' AutoTokenizer does

def bos_tokenizer_json(path, texts):
    # a tiny byte-level BPE learned here, with <|begin_of_text|> put before every text, as Llama 3's is
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                      special_tokens=[("<|begin_of_text|>", 0)])
    hf.save(str(path))


def write_bos_run(folder):
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:12]
    texts = [f.read_text(errors="replace")[:3000] for f in files]
    (folder / "docs").mkdir()
    for i, text in enumerate(texts):
        (folder / "docs" / f"{i:02}.txt").write_text(text)
    bos_tokenizer_json(folder / "tokenizer.json", texts)
    done = script("prepare.py", folder / "docs", f"--tokenizer={folder / 'tokenizer.json'}",
                  f"--out_dir={folder / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*TINY, f"--data_dir={folder / 'data'}", f"--out_dir={folder / 'run'}", "--max_iters=2")


def test_a_bos_adding_tokenizer_begins_every_text_with_it_everywhere(shared, tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = shared("gguf-bos-run", write_bos_run)
    done = script("export.py", f"--out_dir={folder / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert auto.encode("x")[0] == 0  # transformers puts the BOS first, by the post-processor kept
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["add_bos_token"] is True and config["bos_token"] == "<|begin_of_text|>"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["bos_token_id"] == 0
    # the data: every document as AutoTokenizer encodes its text, then end-of-text
    eot = auto.convert_tokens_to_ids("<|endoftext|>")
    texts = [path.read_text() for path in sorted((folder / "docs").iterdir())]
    written = np.concatenate([np.fromfile(folder / "data" / f"{split}.bin", dtype=np.uint16) for split in
                              ("train", "val")]).tolist()
    documents, start = [], 0
    for end in [i for i, token in enumerate(written) if token == eot]:
        documents.append(written[start:end + 1])
        start = end + 1
    assert sorted(documents) == sorted(auto(text)["input_ids"] + [eot] for text in texts)
    # and the data is the folder's tokenizer's, as train.py --init_from and eval.py --model check it
    from lib.files import read_meta
    from lib.tokenizer import check_tokenizer
    check_tokenizer(folder / "data", read_meta(folder / "data"), str(tmp_path / "hf"), len(auto))
    # sample.py's prompt: greedy, its text is transformers' greedy continuation of AutoTokenizer's ids; an empty
    # prompt is the BOS alone, a text's start, as it is to transformers
    done = script("sample.py", f"--out_dir={folder / 'run'}", "--start=", "--temperature=0",
                  "--max_new_tokens=8", "--num_samples=1")
    assert done.returncode == 0, done.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([auto("")["input_ids"]])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         eos_token_id=None, pad_token_id=eot)
    assert done.stdout.split("\n---------------\n")[0] == auto.decode(greedy[0, 1:].tolist())
    # the GGUF file: llama.cpp adds the same BOS
    reader = exported(folder, tmp_path)
    assert value(reader, "tokenizer.ggml.add_bos_token") is True
    assert value(reader, "tokenizer.ggml.bos_token_id") == 0


def test_a_scratch_runs_export_carries_no_file_of_the_folder_it_runs_in(bpe_run, tmp_path, monkeypatch):
    # a run from scratch has no base folder: a generation_config.json where export.py is started is not its own
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 7, "temperature": 0.01}')
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (export.main installs its one-line hook)
    export.main([f"--out_dir={bpe_run / 'run'}", f"--to={tmp_path / 'hf'}"])
    written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    eot = load_tokenizer(bpe_run / "data").eot_id
    assert written["eos_token_id"] == eot != 7 and "temperature" not in written


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_adapted_in_part_is_written_whole(kind, tmp_path):
    # QLoRA with lora_targets='q,v': quantize_base holds all seven projections quantized, the adapters are on two;
    # merge_lora gives plain weights for every one, which both exports write (int8's crashed with a traceback)
    pytest.importorskip("torchao", reason="a quantized base needs torchao")
    from lib.gguf_export import write_gguf
    from lib.lora import add_lora, merge_lora, quantize_base
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("bpe:260", lambda: iter(["hello world, hello there"] * 50))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=320, n_layer=1, n_head=4, n_kv_head=2, n_embd=64, block_size=16))
    model = quantize_base(add_lora(model, 4, targets="q,v"), kind).eval()
    for _, _, linear in model.projections():
        if getattr(linear, "lora", None) is not None:
            torch.nn.init.normal_(linear.lora.B, std=0.02)
    ids = torch.randint(0, 260, (1, 8))
    with torch.no_grad():
        before = model(ids)[0]
        merge_lora(model)
        after = model(ids)[0]
    assert all(type(p.detach()) is torch.Tensor for p in model.parameters())
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    write_gguf(model, tokenizer, tmp_path / "m.gguf", torch.float32, {"eos_token_id": tokenizer.eot_id})
    k = next(t for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if t.name == "blk.0.attn_output.weight")
    assert torch.equal(torch.from_numpy(np.array(k.data)).reshape(64, 64), model.blocks[0].attn.proj.weight.detach())


@pytest.mark.parametrize("step", ["prefix", "lowercase"])
def test_a_tokenizer_json_that_llama_cpp_would_encode_otherwise_is_refused(step):
    # a ByteLevel step with add_prefix_space encodes "hello" as "Ġhello"; llama.cpp's BPE adds no space (nor
    # normalizes): the GGUF file would hold the data's vocabulary but encode every prompt otherwise
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from lib.tokenizer import hf_tokenizer
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=step == "prefix")
    if step == "lowercase":
        hf.normalizer = normalizers.Lowercase()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(["hello world, Hello there"] * 50, trainer)
    with pytest.raises(ValueError) as e:
        vocabulary(hf_tokenizer("odd", hf.to_str()), 320, gguf)
    assert "\n" not in str(e.value) and "llama.cpp's byte-level BPE does not" in str(e.value)


def test_a_tokenizer_json_that_splits_after_its_byte_level_step_is_refused():
    # its regex runs on the byte-level characters ('Ġ' a letter): named llama-bpe, llama.cpp encoded 326 of 803
    # texts otherwise
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from lib.tokenizer import hf_tokenizer
    pattern = next(p for p, name in PRE_TOKENIZERS.items() if name == "llama-bpe")  # (a regex llama.cpp knows)
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    hf = Tokenizer(models.BPE())
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    for steps, refused in (([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)], False),
                           ([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False), split], True)):
        hf.pre_tokenizer = pre_tokenizers.Sequence(steps)
        hf.train_from_iterator(["hello world, Hello there"] * 50, trainer)
        if not refused:
            assert vocabulary(hf_tokenizer("ordered", hf.to_str()), 320, gguf)[3] == "llama-bpe"
            continue
        with pytest.raises(ValueError, match="GGUF here takes byte-level BPE tokenizers only"):
            vocabulary(hf_tokenizer("reordered", hf.to_str()), 320, gguf)


@pytest.mark.slow  # SIGTERM to new Pythons
def test_a_gguf_export_stopped_by_sigterm_leaves_the_earlier_one_and_no_copy(bpe_run, tmp_path):
    from test_one_writer import check_stopped_export
    check_stopped_export(bpe_run / "run", tmp_path / "model.gguf")
