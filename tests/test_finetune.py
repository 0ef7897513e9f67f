"""Fine-tuning a Hugging Face folder end to end: prepare.py with its tokenizer, train.py --init_from=PATH,
resume, sample.py on the folder, export.py back to a folder that transformers loads with equal logits."""

import json
import math
import shutil
import sys

import pytest
import torch

from helpers import (HeadersOnly, assert_every_kernel_ran, assert_no_kernel_ran, kernel_counter, losses, master_reads,
                     run, script, train_refusal, weights)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from lib.hf import load_pretrained, save_pretrained
from lib.lora import add_lora, quantize_base
from model import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.slow  # a Hugging Face folder and a tokenizer to make first (test_pretrained.py is quick)
FINETUNE = ["--block_size=32", "--batch_size=4", "--eval_iters=2", "--log_interval=1", "--warmup_iters=2",
            "--lr_decay_iters=20", "--learning_rate=3e-3", "--eval_interval=5", "--dropout=0.1"]


def corpus_text():
    # a few hundred KB of real text: this Python's own library source
    import sysconfig
    from pathlib import Path
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-k]*.py"))
    return "\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)[:300_000]


@pytest.fixture(scope="module")
def pretrained(shared):
    # a tiny Qwen3 (q/k norm, head_dim of its own) with its own byte-level BPE tokenizer, as on the Hub (read only)
    root = shared("pretrained", make_pretrained)
    return root / "qwen", root / "data"


def make_pretrained(root):
    text = corpus_text()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    folder = root / "qwen"
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=416, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=64, tie_word_embeddings=True)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (root / "corpus").mkdir()
    (root / "corpus" / "text.txt").write_text(text)
    data = root / "data"
    done = script("prepare.py", root / "corpus", f"--tokenizer={folder}", f"--out_dir={data}")
    assert done.returncode == 0, done.stderr


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids)[0] if isinstance(model, GPT) else model(ids).logits


def test_finetune_lowers_val_loss_and_resumes_bit_for_bit(pretrained, tmp_path):
    folder, data = pretrained
    args = [*FINETUNE, f"--data_dir={data}", f"--init_from={folder}"]
    run(*args, f"--out_dir={tmp_path / 'whole'}", "--max_iters=20")
    evals = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in evals if "val_loss" in r]
    assert val[-1] < val[0] - 0.5  # it learns the corpus
    ckpt = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    assert ckpt["pretrained"] == str(folder) and ckpt["model_args"]["block_size"] == 64  # the model's own limit
    assert ckpt["model_args"]["qk_norm"] and ckpt["model_args"]["family"] == "qwen3"
    # stopped at step 7, then the same command again (as after a preemption) continues the run: the same
    # losses and weights as the run that never stopped
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=7")
    out = run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=20")
    assert "iter 8:" in out.stdout and "iter 7:" not in out.stdout
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts")
    whole, parts = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert all(torch.equal(whole[k], parts[k]) for k in whole)


def test_model_settings_a_folder_sets_otherwise_are_said_to_play_no_part(pretrained, tmp_path):
    # from a Hugging Face folder the model is the folder's: a shape given with it (a config file's n_layer, an untied
    # head) is not built, and the run says so, as of any setting out of play; one equal to the folder's, nothing
    # (its vocabulary too, even one below the data's); and the same command again, which resumes the run, says the same
    folder, data = pretrained
    args = [*FINETUNE, f"--data_dir={data}", f"--init_from={folder}", f"--out_dir={tmp_path}", "--n_layer=4",
            "--tie_embeddings=False", "--n_head=4", "--dropout=0.0", "--vocab_size=64"]
    for steps in (1, 2):
        out = run(*args, f"--max_iters={steps}").stdout
        notes = [line for line in out.splitlines() if "plays no part" in line]
        vocab = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model_args"]["vocab_size"]
        assert notes == [f"note: n_layer=4 plays no part in this run: the model is {folder}'s, whose n_layer is 2",
                         f"note: tie_embeddings=False plays no part in this run: the model is {folder}'s, whose "
                         f"tie_embeddings is True",
                         f"note: vocab_size=64 plays no part in this run: the model is {folder}'s, whose "
                         f"vocab_size is {vocab}"], out
        assert (f"resuming {tmp_path / 'ckpt.pt'} at step 1" in out) == (steps == 2)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["model_args"]["n_layer"] == 2


def test_step_zero_is_the_folders_model(pretrained, tmp_path):
    # with no update, the checkpoint holds the folder's weights: the same logits as transformers. The folder's
    # weights re-drawn large first (as test_pretrained.py does): transformers' init gives logits near zero,
    # where a dropped norm (Qwen3's q and k norms) would hardly show
    from test_pretrained import assert_same_logits, randomize
    folder, data = pretrained
    hf = randomize(transformers.AutoModelForCausalLM.from_pretrained(folder)).eval()
    hf.save_pretrained(tmp_path / "large")
    (tmp_path / "large" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={tmp_path / 'large'}", f"--out_dir={tmp_path / 'run'}",
        "--max_iters=1", "--learning_rate=0", "--min_lr=0", "--warmup_iters=0")
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)
    ours = GPT(GPTConfig(**{**ckpt["model_args"], "use_kernels": False})).eval()
    ours.load_state_dict(ckpt["model"])
    ids = torch.randint(0, 400, (2, 24))
    theirs = logits_of(hf, ids)
    assert theirs.std() > 1.0  # large enough that a dropped norm shows
    assert_same_logits(logits_of(ours, ids), theirs)


def test_refusals_are_one_line(pretrained, tmp_path, data_dir):
    folder, data = pretrained
    run(*FINETUNE, f"--data_dir={data}", f"--out_dir={tmp_path / 'scratch'}", "--max_iters=1", "--n_layer=1",
        "--n_head=2", "--n_embd=32")
    cases = [
        ([f"--data_dir={data}", f"--out_dir={tmp_path / 'scratch'}"], "holds a run that began from scratch, not"),
        ([f"--data_dir={data}", "--block_size=65"], "block_size=65 is past the model's max_position_embeddings=64"),
        ([f"--data_dir={data_dir}"], "prepare it with the model's tokenizer"),  # char data without a tokenizer
        ([f"--data_dir={data}", f"--init_from={tmp_path}"], "is not 'scratch', 'resume', 'auto' or a Hugging Face"),
    ]
    for extra, message in cases:  # train.py's checks, in process (helpers.train_refusal)
        assert message in train_refusal(*FINETUNE, f"--init_from={folder}", f"--out_dir={tmp_path / 'out'}", *extra)


def test_sample_a_folder_greedily_as_transformers_does(pretrained):
    folder, _ = pretrained
    done = script("sample.py", f"--model={folder}", "--start=def ", "--temperature=0", "--max_new_tokens=12",
                  "--num_samples=1", "--device=cpu")
    assert done.returncode == 0, done.stderr
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tok.encode("def ", add_special_tokens=False).ids])
    greedy = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    assert done.stdout.split("\n---------------\n")[0] == tok.decode(greedy[0].tolist(), skip_special_tokens=False)


def test_a_prompt_that_is_not_utf8_is_refused_in_one_line(pretrained):
    # bytes that are not UTF-8 in an argument come to Python as lone surrogates, which no tokenizer reads
    folder, _ = pretrained
    for extra in ([], ["--chat", "--system=Be brief."], ["--chat", "--start=Hi", "--system=Be brief \udcff"]):
        done = script("sample.py", f"--model={folder}", "--start=caf\udce9", "--max_new_tokens=2", "--device=cpu",
                      *extra)
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "is not UTF-8 text: give it in UTF-8" in done.stderr


def test_sample_refuses_two_models_and_a_token_past_the_models_embeddings(pretrained, tmp_path):
    # --model with another --init_from folder, or with a run's --out_dir, had sampled one and dropped the other
    # without a word; a folder whose tokenizer has tokens past its embeddings had an IndexError in the first forward
    folder, _ = pretrained
    for extra, says in (([f"--init_from={tmp_path}"], f"--model={folder} and --init_from={tmp_path} name two folders"),
                        ([f"--out_dir={tmp_path}"], "--out_dir and --ckpt name a run's checkpoint, --model a folder")):
        done = script("sample.py", f"--model={folder}", "--start=def ", *extra)
        assert done.returncode == 1 and says in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    config = transformers.AutoConfig.from_pretrained(folder)
    config.vocab_size = 300  # of the tokenizer's 400
    transformers.Qwen3ForCausalLM(config).save_pretrained(tmp_path / "small")
    shutil.copy(folder / "tokenizer.json", tmp_path / "small")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    word = next(w for w in (" the", " and", " of", " to", " that", "ing") if max(tok.encode(w).ids) >= 300)
    past = max(tok.encode(word).ids)
    done = script("sample.py", f"--model={tmp_path / 'small'}", f"--start={word}", "--max_new_tokens=2",
                  "--device=cpu")
    assert done.returncode == 1 and done.stderr.strip() == (
        f"sample.py: the prompt holds {tok.decode([past])!r}, token {past}, which the model has no embedding for (its "
        f"vocab_size is 300): leave it out")


def test_greedy_sampling_prints_one_sample_with_a_note(pretrained):
    folder, _ = pretrained
    done = script("sample.py", f"--model={folder}", "--start=def ", "--temperature=0", "--max_new_tokens=4",
                  "--num_samples=3", "--device=cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("---------------") == 1 and "would be identical: printing one" in done.stderr
    # a run's dataset names a tokenizer, which a folder brings its own of: the pair is refused, not half taken
    done = script("sample.py", f"--model={folder}", f"--data_dir={folder}", "--device=cpu")
    assert done.returncode == 1 and "leave --data_dir out" in done.stderr


# -----------------------------------------------------------------------------
# LoRA and QLoRA

LORA = [*FINETUNE, "--lora_rank=4", "--lora_alpha=8", "--learning_rate=1e-2"]


def test_lora_trains_adapters_only_and_resumes_bit_for_bit(pretrained, tmp_path):
    folder, data = pretrained
    args = [*LORA, f"--data_dir={data}", f"--init_from={folder}"]
    out = run(*args, f"--out_dir={tmp_path / 'whole'}", "--max_iters=12")
    ckpt = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=True)
    assert ckpt["model"] and all(".lora." in name for name in ckpt["model"])  # adapters only, no base
    assert ckpt["model_args"]["lora_rank"] == 4 and len(ckpt["base_fingerprint"]) == 16
    base = sum(p.numel() for p in load_pretrained(folder).parameters())
    assert sum(t.numel() for t in ckpt["model"].values()) < base / 5
    trained = sum(t.numel() for t in ckpt["model"].values())
    assert f"{trained / 1e6:.2f}M of them trained" in out.stdout
    assert "note: lora_" not in out.stdout + out.stderr  # the adapters' settings play their part (the folder has none)
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert val[-1] < val[0] - 0.05  # the adapters alone learn, slowly on a random base (fixed eval batches)
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=6")
    # the adapters are the run's shape: a resume that asks for others is refused in one line, before anything changes
    before = (tmp_path / "parts" / "ckpt.pt").read_bytes()
    for other, said in (("--lora_rank=8", "lora_rank=4, not lora_rank=8"), ("--lora_alpha=4.0", "lora_alpha=")):
        refused = train_refusal(*LORA, other, f"--data_dir={data}", f"--out_dir={tmp_path / 'parts'}",
                                "--max_iters=12", "--init_from=resume")
        assert said in refused and "resume with the checkpoint's shape" in refused, refused
    # and its base as it was held: another dtype would round it otherwise (the export, from the folder, does not)
    refused = train_refusal(*LORA, "--dtype=bfloat16", f"--data_dir={data}", f"--out_dir={tmp_path / 'parts'}",
                            "--max_iters=12", "--init_from=resume")
    assert "holds its frozen base in dtype='float32' (lora_base_dtype='auto'): resume with --dtype=float32" in refused
    assert (tmp_path / "parts" / "ckpt.pt").read_bytes() == before
    # the same targets named in another order are the same adapters
    run(*LORA, f"--data_dir={data}", f"--out_dir={tmp_path / 'parts'}", "--max_iters=12", "--init_from=resume",
        "--lora_targets=" + ",".join(reversed(GPTConfig().lora_targets.split(","))))
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts")
    whole, parts = weights(tmp_path / "whole"), weights(tmp_path / "parts")
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)


def test_lora_refuses_another_base(pretrained, tmp_path):
    folder, data = pretrained
    base = tmp_path / "base"
    base.mkdir()
    for f in folder.iterdir():
        (base / f.name).write_bytes(f.read_bytes())
    run(*LORA, f"--data_dir={data}", f"--init_from={base}", f"--out_dir={tmp_path / 'out'}", "--max_iters=2")
    model = load_pretrained(base)
    with torch.no_grad():
        model.blocks[0].mlp.down.weight.mul_(1.01)  # another model of the same shape
    save_pretrained(model, base)
    # train.py's checks, in process (helpers.train_refusal)
    assert "is not the one this LoRA run began from" in train_refusal(
        *LORA, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=4", "--init_from=resume")
    no_folder = train_refusal(*LORA, f"--data_dir={data}", f"--out_dir={tmp_path / 'x'}")  # nothing to adapt
    assert "LoRA adapts a pretrained model" in no_folder


# A config file for train.py that prints, at the model's first forward, the type of each frozen parameter (the
# model as it trains, whatever built it): a 4-bit base must be torchao's NF4Tensor there, not merely train.
FROZEN_TYPES = """
import atexit as _atexit, json as _json
import torch as _torch
from torch._subclasses.fake_tensor import is_fake as _is_fake


def _report(module, args):  # the first training forward's model (not the memory estimate's trace, on fake tensors)
    if type(module).__name__ == "GPT" and not _reported and not _is_fake(args[0]):
        _reported.append(module)
        kinds = {name: type(p).__name__ for name, p in module.named_parameters() if not p.requires_grad}
        print("FROZEN " + _json.dumps(kinds), flush=True)


_reported = []
_hook = _torch.nn.modules.module.register_module_forward_pre_hook(_report)
_atexit.register(lambda: _hook.remove())  # for a run in the test's own process
"""
PROJECTIONS = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.proj.weight", "mlp.gate.weight",
               "mlp.up.weight", "mlp.down.weight")


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_is_quantized_as_it_is_read_never_whole_in_its_dtype(pretrained, monkeypatch, kind):
    # train.py, sample.py and eval.py read a QLoRA base with hf.load_pretrained(quantized=): each projection's
    # weight is quantized as the folder gives it, no other held in bf16 meanwhile (a 70B base: 140 GB of host
    # memory in every process), and the same weights as quantize_base gives the whole bf16 model
    pytest.importorskip("torchao", reason="a 4-bit or 8-bit base needs torchao (pip install torchao)")
    from lib import lora
    folder, _ = pretrained
    built, held, quantize, materialize = [], [], lora.quantize_weight, GPT.materialize

    def counted(linear, weight, *args, **kwargs):  # as each is quantized: the projections that hold a plain weight
        held.append(sum(type(getattr(other, "weight", None)) is torch.nn.Parameter
                        for _, _, other in built[-1].projections()))
        quantize(linear, weight, *args, **kwargs)

    monkeypatch.setattr(lora, "quantize_weight", counted)
    monkeypatch.setattr(GPT, "materialize", lambda self: built.append(self) or materialize(self))
    model = load_pretrained(folder, torch.bfloat16, quantized=kind, device="cpu")
    projections = 7 * len(model.blocks)
    assert held == [0] * projections
    whole = quantize_base(load_pretrained(folder, torch.bfloat16), kind)  # all read first: all held as it begins
    assert held[projections:] == list(range(projections, 0, -1))
    plain = [(a.weight.dequantize(), b.weight.dequantize()) if kind == "int8" else
             (a.weight.get_original_weight(), b.weight.get_original_weight())
             for (_, _, a), (_, _, b) in zip(model.projections(), whole.projections())]
    assert all(torch.equal(a, b) for a, b in plain)
    ids = torch.randint(0, 400, (1, 16))
    assert torch.equal(logits_of(model, ids), logits_of(whole, ids))


def test_a_weight_nf4_cannot_hold_is_refused_in_one_line_naming_the_fix():
    # nf4 holds blocks of 64 values: a projection of 36 x 36 (1,296 values) is none, int8 holds it
    pytest.importorskip("torchao", reason="a 4-bit or 8-bit base needs torchao (pip install torchao)")
    from lib.files import UserError
    from lib.lora import quantize_weight
    linear = torch.nn.Linear(36, 36, bias=False)
    said = r"^a \(36, 36\) weight cannot be held in nf4 \(blocks of 64 values\): hold this model's base with "
    with pytest.raises(UserError, match=said + r"lora_base_dtype='int8', or in its own dtype \('auto'\)$"):
        quantize_weight(linear, linear.weight.detach(), "nf4")
    quantize_weight(linear, linear.weight.detach(), "int8", "cpu")
    assert type(linear.weight).__name__ == "Int8Tensor"


@pytest.mark.parametrize("kind,tensor", [("nf4", "NF4Tensor"), ("int8", "Int8Tensor")])
def test_quantized_base_trains(pretrained, tmp_path, kind, tensor):
    pytest.importorskip("torchao", reason="a 4-bit or 8-bit base needs torchao (pip install torchao)")
    from lib.lora import merge_lora
    from lib.trained import load_model
    folder, data = pretrained
    # quantize_base holds every projection's weight in NF4 (or int8), and nothing else
    model = quantize_base(add_lora(load_pretrained(folder), 4), kind)
    quantized = {name for name, p in model.named_parameters() if type(p).__name__ == tensor}
    assert quantized == {name for name, _ in model.named_parameters() if name.endswith(PROJECTIONS)}
    assert len(quantized) == 7 * len(model.blocks)
    ids = torch.randint(0, 400, (1, 16))
    for _, _, linear in model.projections():  # an adapter that does something, to merge
        torch.nn.init.normal_(linear.lora.B, std=0.02)
    before = logits_of(model, ids)
    merged = merge_lora(model)  # back to plain weights: base dequantized + the adapters
    assert not any(type(p).__name__ == tensor for p in merged.parameters())
    torch.testing.assert_close(logits_of(merged, ids), before, atol=1e-4, rtol=1e-4)
    (tmp_path / "frozen_types.py").write_text(FROZEN_TYPES)
    out = run(*LORA, f"--lora_base_dtype={kind}", f"--data_dir={data}", f"--init_from={folder}",
              f"--out_dir={tmp_path / 'run'}", "--max_iters=5", "--eval_full=True", "--eval_stride=8",
              str(tmp_path / "frozen_types.py"))
    frozen = json.loads(out.stdout.split("FROZEN ")[1].splitlines()[0])
    assert {name for name, kind in frozen.items() if kind == tensor} == quantized  # train.py's model too
    # a resume without the setting holds the base as it was, and says so in the checkpoints it writes
    run(*LORA, f"--data_dir={data}", "--init_from=resume", f"--out_dir={tmp_path / 'run'}", "--max_iters=10",
        "--eval_full=True", "--eval_stride=8")
    assert torch.load(tmp_path / "run" / "ckpt.pt", weights_only=True)["config"]["lora_base_dtype"] == kind
    other = "int8" if kind == "nf4" else "nf4"  # a resume with another is refused, never silently left out
    assert f"was trained on a base held as lora_base_dtype='{kind}'; resume with that" in train_refusal(
        *LORA, f"--lora_base_dtype={other}", f"--data_dir={data}", "--init_from=resume",
        f"--out_dir={tmp_path / 'run'}")
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert val[-1] < val[0] - 0.05
    # sample.py, eval.py and export.py rebuild the run on its base held as it trained (nf4 or int8): eval.py's val
    # loss is the one its log shows (the two sum 15,000 fp32 losses in other orders; the unquantized base's is
    # ~5e-6 off at this tiny size)
    model, _ = load_model(str(tmp_path / "run" / "ckpt.pt"))
    assert {name for name, p in model.named_parameters() if type(p).__name__ == tensor} == quantized
    done = script("eval.py", f"--out_dir={tmp_path / 'run'}", "--device=cpu", "--block_size=32", "--stride=8")
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip().splitlines()[-1].split()[2]) == pytest.approx(val[-1], rel=2e-6)


def test_a_qlora_run_in_bfloat16_is_exported_on_the_base_it_trained_on(pretrained, tmp_path, monkeypatch):
    # trained in bf16, its nf4 base was quantized from the bf16 weights: export.py (and eval.py, sample.py, whatever
    # dtype they compute in) quantize from the same, or ~1% of the values take another of nf4's codes. Its adapter
    # alone is the checkpoint's A and B, exported where torchao is not installed too
    pytest.importorskip("torchao", reason="a 4-bit base needs torchao (pip install torchao)")
    from safetensors.torch import load_file

    from lib.resume import load_checkpoint, model_from_checkpoint
    from lib.lora import merge_lora
    folder, data = pretrained
    run(*LORA, "--lora_base_dtype=nf4", "--dtype=bfloat16", f"--data_dir={data}", f"--init_from={folder}",
        f"--out_dir={tmp_path / 'run'}", "--max_iters=2")
    done = export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    assert f"(the adapters merged into {folder} as the run held it: nf4, dequantized)" in done.stdout, done.stdout
    trained = quantize_base(model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), torch.bfloat16))
    merged = dict(merge_lora(trained).named_parameters())
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    ours = merged["blocks.0.mlp.gate.weight"]
    assert torch.equal(exported["model.layers.0.mlp.gate_proj.weight"].to(ours.dtype), ours)
    # the adapter alone goes on the folder's own weights, which it did not train on: said, not silent
    done = export("--out_dir", tmp_path / "run", "--to", tmp_path / "adapter", "--adapter")
    assert f"note: the adapters trained on {folder} held as nf4, and peft puts them on its own weights" in done.stdout
    for name in [n for n in sys.modules if n.split(".")[0] == "torchao"] or ["torchao"]:  # as if not installed:
        monkeypatch.setitem(sys.modules, name, None)  # each of its imports fails
    refused = export("--out_dir", tmp_path / "run", "--to", tmp_path / "no", check=False)
    assert refused.returncode == 1 and "need torchao: pip install torchao" in refused.stderr

    import safetensors  # an adapter alone reads none of the base's weights (a 70B base's 140 GB), headers only
    monkeypatch.setattr(safetensors, "safe_open", HeadersOnly)
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "without", "--adapter")
    adapter, without = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("adapter", "without"))
    assert adapter.keys() == without.keys() and all(torch.equal(adapter[k], without[k]) for k in adapter)


def test_a_lora_run_on_a_bfloat16_base_exports_in_float32_with_its_adapters_whole(pretrained, tmp_path):
    # a float32 folder's LoRA run held in bf16 (a GPU's dtype) exports in float32: W + delta, not rounded to bf16
    # first, which lost ~5% of the adapters' change (the small entries of B·A below a bf16 weight's last bit)
    from safetensors.torch import load_file

    from lib.resume import load_checkpoint, model_from_checkpoint
    folder, data = pretrained
    run(*LORA, "--lora_base_dtype=bfloat16", f"--data_dir={data}", f"--init_from={folder}",
        f"--out_dir={tmp_path / 'run'}", "--max_iters=2")
    done = export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    assert f"(the adapters merged into {folder} as the run held it: bfloat16)" in done.stdout, done.stdout
    trained = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt.pt"), torch.bfloat16)
    q = trained.blocks[0].attn.q
    exported = load_file(tmp_path / "hf" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert exported.dtype == torch.float32 and q.lora.delta().abs().max() > 0
    torch.testing.assert_close(exported, q.weight.float() + q.lora.delta(), rtol=0, atol=1e-7)
    # the adapter alone goes on the folder's float32 weights, which it did not train on: said, not silent
    done = export("--out_dir", tmp_path / "run", "--to", tmp_path / "adapter", "--adapter")
    assert f"note: the adapters trained on {folder} held as bfloat16, and peft puts them on its own weights" \
        in done.stdout, done.stdout


# -----------------------------------------------------------------------------
# export.py: a run -> a Hugging Face folder (or a peft adapter) that transformers reads as we do


def export(*args, check=True):
    done = script("export.py", *args)
    assert not check or done.returncode == 0, done.stderr
    return done


def run_model(out_dir):
    # the model of a run's checkpoint, as sample.py and export.py rebuild it
    from lib.resume import load_checkpoint, model_from_checkpoint
    return model_from_checkpoint(load_checkpoint(out_dir / "ckpt.pt"), use_kernels=False).eval()


def test_export_a_finetune_loads_in_transformers_with_equal_logits(pretrained, tmp_path):
    folder, data = pretrained
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={folder}", f"--out_dir={tmp_path / 'run'}", "--max_iters=5")
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["max_position_embeddings"] == 64
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 400, (2, 24))
    ours = logits_of(run_model(tmp_path / "run"), ids)
    assert (logits_of(hf, ids) - ours).abs().max() <= 1e-4 * ours.abs().max()
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = corpus_text()[:5000]
    from lib.tokenizer import load_tokenizer
    assert auto(text, add_special_tokens=False)["input_ids"] == load_tokenizer(data).encode(text)
    out = export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf", check=False)  # never over a folder
    assert out.returncode != 0 and "pass --overwrite" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf", "--overwrite", "--dtype", "bfloat16")
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").dtype == torch.bfloat16


def test_a_fine_tune_whose_base_moved_is_exported_once_it_is_back(pretrained, tmp_path):
    # the checkpoint holds every weight (sample.py needs no base), but an export takes the base's special tokens
    # and tokenizer files: one line that says where to put the base, then the export from the base back there
    import shutil
    folder, data = pretrained
    base = shutil.copytree(folder, tmp_path / "base")
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={base}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    base.rename(tmp_path / "moved")
    for to in ("hf", "model.gguf"):
        out = export("--out_dir", tmp_path / "run", "--to", tmp_path / to, check=False)
        assert out.returncode != 0 and out.stderr.strip().splitlines() == [
            f"export.py: the base model this run began from is not at {base}, and its export takes the base's "
            f"special tokens and tokenizer files from there: put it back there"]
    (tmp_path / "moved").rename(base)
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")


def test_an_export_takes_the_dtype_of_the_folder_the_run_began_from(pretrained, tmp_path):
    # --dtype=auto (the default): a run from a bfloat16 folder, trained in float32, exports bfloat16 weights
    from safetensors.torch import load_file, save_file
    folder, data = pretrained
    shutil.copytree(folder, tmp_path / "bf16")
    weights = load_file(tmp_path / "bf16" / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, tmp_path / "bf16" / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config.pop("dtype", None)
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={tmp_path / 'bf16'}", f"--out_dir={tmp_path / 'run'}",
        "--max_iters=2", "--dtype=float32")
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (exported.get("torch_dtype") or exported.get("dtype")) == "bfloat16"
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.bfloat16}


@pytest.mark.parametrize("named", ["float64", "auto"])
def test_a_folder_whose_dtype_is_none_we_write_exports_the_checkpoints_float32(pretrained, tmp_path, named):
    # --dtype=auto took a config.json's torch_dtype as it was: float64 a KeyError (GGUF), "auto" an AttributeError
    from safetensors.torch import load_file
    folder, data = pretrained
    shutil.copytree(folder, tmp_path / "base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    config.pop("dtype", None)
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, "torch_dtype": named}))
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={tmp_path / 'base'}", f"--out_dir={tmp_path / 'run'}",
        "--max_iters=1")
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    assert {t.dtype for t in load_file(tmp_path / "hf" / "model.safetensors").values()} == {torch.float32}


def test_adapters_start_as_their_base_with_the_runs_dropout():
    # B starts at zero: an adapted model's logits are its base's exactly, whatever A drew; lora_dropout is each
    # adapter's own
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)).eval()
    ids = torch.randint(0, 64, (2, 16))
    def outputs():  # the logits, and the loss (computed without them)
        return model(ids)[0], model(ids, ids)[1]
    base = outputs()
    add_lora(model, 4, 8.0, 0.1, "q,k,v,o,gate,up,down")
    adapters = [linear.lora for _, _, linear in model.projections()]
    assert len(adapters) == 2 * 7 and all(a.dropout.p == 0.1 and not a.B.any() and a.A.any() for a in adapters)
    model.eval()
    assert all(torch.equal(a, b) for a, b in zip(outputs(), base))


def test_lora_exports_merged_and_as_a_peft_adapter_with_the_same_logits(pretrained, tmp_path):
    peft = pytest.importorskip("peft")
    folder, data = pretrained
    run(*LORA, "--lora_targets=q,v,o,down", "--lora_dropout=0.1", f"--data_dir={data}", f"--init_from={folder}",
        f"--out_dir={tmp_path / 'run'}", "--max_iters=6")
    ids = torch.randint(0, 400, (2, 24))
    ours = logits_of(run_model(tmp_path / "run"), ids)  # adapters on the base, not merged
    base_logits = logits_of(load_pretrained(folder).eval(), ids)
    assert (ours - base_logits).abs().max() > 1e-3  # the adapters learned something
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "merged")
    merged = logits_of(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval(), ids)
    assert (merged - ours).abs().max() <= 1e-4 * ours.abs().max()
    done = export("--out_dir", tmp_path / "run", "--to", tmp_path / "adapter", "--adapter")
    assert "note" not in done.stdout  # (on the base it trained on: nothing to say)
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == ["down_proj", "o_proj", "q_proj", "v_proj"]
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["lora_dropout"]) == (4, 8, 0.1)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert (logits_of(with_adapter, ids) - merged).abs().max() <= 1e-4 * merged.abs().max()
    # --dtype casts the adapter too (it was written in float32 whatever it said), as peft's own bf16 ones are
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "bf16", "--adapter", "--dtype=bfloat16")
    from safetensors.torch import load_file
    written, bf16 = (load_file(tmp_path / name / "adapter_model.safetensors") for name in ("adapter", "bf16"))
    assert written.keys() == bf16.keys() and all(t.dtype == torch.float32 for t in written.values())
    assert all(torch.equal(bf16[k], written[k].to(torch.bfloat16)) for k in written)


def test_lora_on_a_model_trained_here(pretrained, tmp_path):
    # train from scratch on a bpe dataset, export it, fine-tune the export with LoRA on the same data
    folder, _ = pretrained
    data = tmp_path / "data"
    done = script("prepare.py", folder.parent / "corpus", "--tokenizer=bpe:300", f"--out_dir={data}")
    assert done.returncode == 0, done.stderr
    shape = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=64"]
    run(*FINETUNE, *shape, f"--data_dir={data}", f"--out_dir={tmp_path / 'scratch'}", "--max_iters=10")
    export("--out_dir", tmp_path / "scratch", "--to", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    run(*LORA, f"--data_dir={data}", f"--init_from={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'lora'}",
        "--max_iters=10")
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    # Early in training most of the gain is in the embeddings, which LoRA leaves frozen: a small fall
    # (the evaluation batches are the same each time, so any fall is the adapters' doing).
    assert val[-1] < val[0]


def test_lora_under_ddp_matches_one_process(pretrained, tmp_path):
    # 2 processes x 1 micro-step see the sequences of 1 process x 2 micro-steps: the same adapters. The folder's
    # weights are read by the master alone (the other process cannot: master_reads), and sent by DDP
    folder, data = pretrained
    args = [*LORA, f"--data_dir={data}", f"--init_from={folder}", "--max_iters=4", "--gradient_accumulation_steps=2",
            "--dropout=0.0"]
    run(*args, f"--out_dir={tmp_path / 'one'}")
    run(*args, f"--out_dir={tmp_path / 'ddp'}", master_reads(tmp_path / "reads.py"),
        torchrun=["--standalone", "--nproc_per_node=2"])
    one, ddp = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert one.keys() == ddp.keys() and all(abs(one[i] - ddp[i]) < 1e-5 for i in one)
    a, b = weights(tmp_path / "one"), weights(tmp_path / "ddp")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_qlora_under_ddp_in_float32_matches_one_process(pretrained, tmp_path, kind):
    # a quantized base in float32 (a CPU's dtype) under DDP: each process reads its own (DDP's first broadcast leaves
    # it out: int8 has no view for it), its saves compare the replicas' trained weights alone (the 4-bit base has no
    # sum of its own), and the adapters are one process's
    pytest.importorskip("torchao", reason="a quantized base needs torchao (pip install torchao)")
    folder, data = pretrained
    args = [*LORA, f"--data_dir={data}", f"--init_from={folder}", "--max_iters=4", "--gradient_accumulation_steps=2",
            "--dropout=0.0", f"--lora_base_dtype={kind}", "--eval_interval=2"]
    run(*args, f"--out_dir={tmp_path / 'one'}")
    run(*args, f"--out_dir={tmp_path / 'ddp'}", torchrun=["--standalone", "--nproc_per_node=2"])
    one, ddp = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    # (float32's rounding of the dequantized matmuls, summed in another order: 1e-6 of the loss at step 1)
    assert one.keys() == ddp.keys() and all(abs(one[i] - ddp[i]) < 2e-5 * one[i] for i in one), (one, ddp)


def test_lora_compiled_with_the_triton_kernels_matches_eager(pretrained, tmp_path):
    # torch.compile and the fused ops (Triton's interpreter on CPU: a tiny batch) around the adapters
    folder, data = pretrained
    args = [*LORA, f"--data_dir={data}", f"--init_from={folder}", "--max_iters=2", "--block_size=16",
            "--batch_size=1", "--eval_interval=2", "--eval_iters=1", "--dropout=0.0"]
    counter = kernel_counter(tmp_path)
    out = run(*args, f"--out_dir={tmp_path / 'fused'}", "--use_kernels=True", "--compile=True", counter,
              env={"TRITON_INTERPRET": "1"})
    assert_every_kernel_ran(out.stdout)  # the fused ops ran (the plain ones would give the same losses)
    assert_no_kernel_ran(run(*args, f"--out_dir={tmp_path / 'plain'}", "--use_kernels=False", counter).stdout)
    fused, plain = losses(tmp_path / "fused"), losses(tmp_path / "plain")
    assert fused.keys() == plain.keys() == {1, 2} and all(abs(fused[i] - plain[i]) < 1e-5 for i in fused)
    assert torch.load(tmp_path / "fused" / "ckpt.pt", weights_only=True)["model_args"]["use_kernels"] is True


@pytest.mark.parametrize("config", ["config/finetune_qwen3.py", "config/lora_qwen3.py", "config/sft_qwen3_full.py"])
def test_the_shipped_fine_tune_configs_run(pretrained, tmp_path, config):
    # the configs as a user runs them, on the tiny folder and for a few steps: eager, as their comments say for a
    # run of a few steps (compiled, each took ~45 s on 2 cores; a compiled LoRA step is tested on its own, above)
    folder, data = pretrained
    out = run(config, f"--init_from={folder}", f"--data_dir={data}", f"--out_dir={tmp_path}", "--block_size=32",
              "--batch_size=2", "--gradient_accumulation_steps=1", "--max_iters=2", "--eval_interval=2",
              "--eval_iters=1", "--compile=False")
    model_line = next(line for line in out.stdout.splitlines() if line.startswith("model: "))
    assert "'block_size': 32" in model_line and "(the model's limit: " in model_line  # the length trained at
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == 2 and ckpt["model_args"]["lora_rank"] == (16 if "lora" in config else 0)
    if "sft" in config:  # a full fine-tune: every weight trains, at a full fine-tune's learning rate
        assert ckpt["config"]["lora_rank"] == 0 and 1e-5 <= ckpt["config"]["learning_rate"] <= 2e-5


def test_lora_on_a_bfloat16_folder_samples_on_a_cpu(pretrained, tmp_path):
    # released models are bf16: the frozen base stays bf16 where asked, the fp32 adapters still fit it
    folder, data = pretrained
    bf16 = tmp_path / "bf16"
    save_pretrained(load_pretrained(folder, torch.bfloat16), bf16)
    (bf16 / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    run(*LORA, f"--data_dir={data}", f"--init_from={bf16}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2")
    done = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--start=def ", "--num_samples=1",
                  "--max_new_tokens=8", "--device=cpu")
    assert done.returncode == 0 and done.stdout.startswith("def "), done.stderr
    model = add_lora(load_pretrained(bf16), 4)  # bf16 base, fp32 adapters, no autocast
    assert model(torch.randint(0, 400, (1, 8)))[0].dtype == torch.bfloat16


def test_sft_config_on_conversations_with_lora_under_fsdp(pretrained, tmp_path):
    # config/sft_qwen3.py as a user runs it: conversations prepared with the folder's tokenizer (it has no chat
    # template: the built-in one), LoRA on whole examples, two processes under FSDP; then a chat with the run
    from test_sft import conversations
    folder, _ = pretrained
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(record) + "\n" for record in conversations(200, seed=1)))
    done = script("prepare.py", chats, f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}")
    assert done.returncode == 0, done.stderr
    assert "[[" in done.stdout and json.loads((tmp_path / "data" / "meta.json").read_text())["masks"] is True
    out = run("config/sft_qwen3.py", f"--init_from={folder}", f"--data_dir={tmp_path / 'data'}",
              f"--out_dir={tmp_path / 'run'}", "--block_size=64", "--batch_size=2", "--gradient_accumulation_steps=2",
              "--max_iters=3", "--eval_interval=3", "--fsdp=True", torchrun=["--standalone", "--nproc_per_node=2"])
    assert "max_epochs=3: 3 steps" in out.stdout and "packed into" in out.stdout
    state = torch.load(tmp_path / "run" / "ckpt" / "state.pt", weights_only=True)
    assert state["iter_num"] == 3 and state["model_args"]["lora_rank"] == 16
    done = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=apple river",
                  "--max_new_tokens=5", "--device=cpu", "--temperature=0")
    assert done.returncode == 0 and done.stdout.endswith("\n"), done.stderr  # the reply, on its own line
    # the folder itself has no chat template: it never learned one, and --chat says so in one line
    done = script("sample.py", f"--model={folder}", "--chat", "--start=apple river", "--device=cpu")
    assert done.returncode != 0 and "has no chat template" in done.stderr and len(done.stderr.splitlines()) == 1
    # its adapter alone carries the run's tokenizer and chat template (the base folder has none), as its merged
    # export does: peft and vLLM read a tokenizer beside the adapter
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "adapter", "--adapter")
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "merged")
    messages = [{"role": "user", "content": "apple river"}]
    chats = [transformers.AutoTokenizer.from_pretrained(tmp_path / name).apply_chat_template(messages, tokenize=False)
             for name in ("adapter", "merged")]
    assert chats[0] == chats[1] and "apple river" in chats[0]


def text_fine_tune_of_a_chat_model(pretrained, tmp_path, where="tokenizer_config.json"):
    # the tiny base given a chat template (in where), fine-tuned on text in tmp_path/run and exported to tmp_path/hf
    # -> the template
    import shutil
    folder, data = pretrained
    base = shutil.copytree(folder, tmp_path / "chat-base")
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    config = {"eos_token": "<|endoftext|>"}
    if where == "chat_template.jinja":
        (base / where).write_text(template)
    else:
        config["chat_template"] = template
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    run(*FINETUNE, f"--data_dir={data}", f"--init_from={base}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2")
    export("--out_dir", tmp_path / "run", "--to", tmp_path / "hf")
    return template


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_text_fine_tune_of_a_chat_model_chats_with_its_template_as_its_export_does(pretrained, tmp_path, where):
    # a base whose tokenizer_config.json (or, as newer folders, chat_template.jinja) holds a chat template,
    # fine-tuned on text: the run's data has no template, and sample.py --chat takes the base's (the data was made
    # with its very tokenizer.json), the one its export carries: the same reply from the run and from the export
    template = text_fine_tune_of_a_chat_model(pretrained, tmp_path, where)
    chat = ["--chat", "--start=def main", "--max_new_tokens=8", "--temperature=0", "--device=cpu"]
    ours = script("sample.py", f"--out_dir={tmp_path / 'run'}", *chat)
    assert ours.returncode == 0, ours.stderr  # it answered: no "has no chat template"
    exported = script("sample.py", f"--model={tmp_path / 'hf'}", *chat)
    assert exported.returncode == 0, exported.stderr
    assert ours.stdout.strip() and ours.stdout == exported.stdout
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (tmp_path / "hf" / "special_tokens_map.json").read_text() == '{"eos_token": "<|endoftext|>"}'  # carried
    # a reply ends at an end-of-text generation_config.json names (as transformers' generate does), not only at the
    # template's end-of-turn: with every id one, the reply ends before its first token
    vocab = json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"]
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocab))}))
    ended = script("sample.py", f"--model={tmp_path / 'hf'}", *chat)
    assert ended.returncode == 0 and ended.stdout == "\n", ended.stderr


def test_an_exported_chat_template_renders_with_the_tokens_its_data_was_rendered_with(tmp_path):
    # a tokenizer folder whose tokenizer_config.json names <|im_end|> as eos_token, its template ending a turn with
    # {{ eos_token }}: the data was rendered so (meta.json's chat), and the export's tokenizer_config.json, written
    # with the tokenizer's own end-of-text, takes the template's tokens, or transformers renders <|endoftext|>
    import export
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": "<s>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 300}))
    chat = {"template": "{{ messages[0]['content'] + eos_token }}", "eos_token": "<|im_end|>", "bos_token": "",
            "end_of_turn_id": 302}
    export.write_chat(tmp_path, chat, 300)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["bos_token"]) == ("<|im_end|>", "<s>")  # (no BOS in the template's: kept)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [302, 300]


@pytest.mark.slow  # lm_eval's import alone is seconds, in each of two scripts
def test_eval_tasks_through_a_text_fine_tunes_chat_template_score_as_its_export(pretrained, tmp_path):
    # eval.py --tasks --apply_chat_template takes the template sample.py chats with (the base's: the run's data has
    # none), so the run and its export (which carries that template) score the same, item for item
    from test_harness import OFFLINE, ROOT_TASKS, needs_lm_eval, write_tasks
    needs_lm_eval()
    text_fine_tune_of_a_chat_model(pretrained, tmp_path)
    tasks = write_tasks(tmp_path / "tasks")
    scores = {}
    for name, source in (("run", f"--out_dir={tmp_path / 'run'}"), ("hf", f"--model={tmp_path / 'hf'}")):
        done = script("eval.py", source, f"--tasks={','.join(ROOT_TASKS)}", f"--include_path={tasks}",
                      "--apply_chat_template", "--limit=3", "--batch_size=2", "--device=cpu",
                      f"--output={tmp_path / name}.json", env=OFFLINE)
        assert done.returncode == 0, done.stderr  # the run's: no "has no chat template"
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())["results"]
    assert set(ROOT_TASKS) <= scores["run"].keys()
    assert scores["run"] == scores["hf"]


def test_eval_refuses_a_folder_with_a_run_or_without_a_dataset(pretrained, tmp_path):
    # a run's --out_dir/--ckpt beside --model had been dropped without a word; a --data_dir that is no dataset had
    # been called one of GPT-2's 50,257 ids (read_meta's stand-in for a nanoGPT folder without meta.pkl)
    folder, data = pretrained
    for extra, says in ((["--ckpt=ckpt_best.pt", f"--data_dir={data}"], "--out_dir and --ckpt name a run's checkpoint"),
                        ([f"--data_dir={tmp_path / 'typo'}"], f"{tmp_path / 'typo'} holds no prepared dataset")):
        done = script("eval.py", f"--model={folder}", "--device=cpu", *extra)
        assert done.returncode == 1 and says in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    # --tasks' results go to the current folder: where that is the model folder (someone else's), not there
    done = script("eval.py", f"--model={folder}", "--tasks=hellaswag", "--device=cpu", cwd=folder)
    assert done.returncode == 1 and done.stderr.strip() == f"eval.py: the results would go to eval_tasks.json in the " \
        f"model folder {folder}: give --output=PATH" and not (folder / "eval_tasks.json").exists(), done.stderr


def test_eval_sizes_a_folders_window_from_the_data_not_its_context(pretrained, tmp_path):
    # a folder that could read 32,768 tokens, scored on a val split of 501: one window of 500 (the longest val
    # document, without its last token, which has no next), said in its output; no 32K window
    import shutil
    import numpy as np
    folder, data = pretrained
    folder = shutil.copytree(folder, tmp_path / "long")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    data = shutil.copytree(data, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    np.fromfile(data / "val.bin", dtype=meta["dtype"])[:501].tofile(data / "val.bin")
    meta["val"]["tokens"] = 501
    (data / "meta.json").write_text(json.dumps(meta))
    done = script("eval.py", f"--model={folder}", f"--data_dir={data}", "--device=cpu")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "window: 500 tokens, from the longest val document (501 tokens)" in lines[0]
    assert lines[-2].startswith("1 windows of 500 tokens") and lines[-1].endswith("over 500 tokens")


def test_eval_scores_every_val_token_once_as_transformers_does(pretrained, tmp_path):
    # eval.py on a Hugging Face folder: windows of 32 overlapping by 8, each token scored once, the loss equal to
    # transformers' own logits on the same windows
    import re
    import shutil
    import numpy as np
    folder, data = pretrained
    # the first 1,001 of the val split's ~15,000 tokens (42 windows, the last one short) score the same way as all
    # of them, in a fifteenth of the time
    data = shutil.copytree(data, tmp_path / "data")
    meta = json.loads((data / "meta.json").read_text())
    ids = np.fromfile(data / "val.bin", dtype=meta["dtype"])[:1001]
    ids.tofile(data / "val.bin")
    meta["val"]["tokens"] = len(ids)
    (data / "meta.json").write_text(json.dumps(meta))
    done = script("eval.py", f"--model={folder}", f"--data_dir={data}", "--block_size=32", "--stride=8",
                  "--device=cpu")
    assert done.returncode == 0, done.stderr
    found = re.fullmatch(r"val loss (\S+) perplexity (\S+) over (\d+) tokens", done.stdout.strip().splitlines()[-1])
    loss, perplexity, count = float(found[1]), float(found[2]), int(found[3])
    ids = ids.astype(np.int64)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    nll, scored, start, done_until = 0.0, 0, 0, 0  # done_until: the last token scored so far
    while done_until < len(ids) - 1:
        window = torch.from_numpy(ids[start:start + 33])
        with torch.no_grad():
            logp = torch.log_softmax(hf(window[None, :-1]).logits[0].float(), dim=-1)
        for t in range(len(window) - 1):
            if start + t + 1 > done_until:
                nll -= logp[t, window[t + 1]].item()
                scored += 1
        done_until, start = start + len(window) - 1, start + 24
    assert count == scored == len(ids) - 1
    assert abs(loss - nll / scored) < 1e-4 and perplexity == pytest.approx(math.exp(loss), rel=1e-4)


@pytest.mark.parametrize("base", [None, "int8", "nf4"])
def test_a_compiled_fine_tuning_step_has_no_graph_break_and_no_recompile(base):
    # a Qwen3-shaped model (q/k norms) with LoRA on its seven projections, its base as it is or quantized (torchao's
    # int8 and nf4 tensors), compiled whole (fullgraph: a graph break raises) through AOTAutograd; three steps of new
    # batches recompile nothing (torch's config.patch: undoing a monkeypatch of its config deletes the setting)
    import torch._dynamo
    if base:
        pytest.importorskip("torchao", reason="a 4-bit or 8-bit base needs torchao (pip install torchao)")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=64, n_layer=1, n_head=2, n_kv_head=1, n_embd=64, head_size=32,
                          qk_norm=True, use_kernels=False))
    add_lora(model, 4, 16.0, 0.0, "q,k,v,o,gate,up,down")
    if base:
        quantize_base(model, base)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # no code generated: fast on a CPU
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(3):
            idx = torch.randint(0, 64, (2, 9))
            _, loss = compiled(idx[:, :-1], idx[:, 1:])
            loss.backward()
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and torch.isfinite(p.grad).all() for p in trained)


def test_lora_targets_with_a_name_that_is_no_projection_names_it():
    # 'q, v' (a space after the comma) said only that the targets "must name some of q,k,v,...": they did
    from lib.files import UserError
    model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8))
    with pytest.raises(UserError, match="lora_targets='q, v': ' v' is none of q,k,v,o,gate,up,down"):
        add_lora(model, 4, targets="q, v")
    with pytest.raises(UserError, match="lora_rank=0 must be at least 1"):
        add_lora(model, 0, targets="q,v")
