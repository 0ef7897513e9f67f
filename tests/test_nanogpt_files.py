"""What a nanoGPT user brings: its config files run as they are (dataset='NAME' reads data/NAME, bias=False is this
model, eval_only=True evaluates once and writes nothing), its checkpoint is recognised in one line by every script
that reads one, and its GPT-2 starting points (init_from='gpt2', a GPT-2 folder) are answered with what to do.
The checkpoint is one made here in nanoGPT's format (its keys and weight names), not by nanoGPT's code."""

import json
import shutil

import pytest
import torch

from helpers import SHARED, TINY, run, script, train_refusal
from test_nanogpt_data import OWN_TEXT, nanogpt_char_folder

# nanoGPT's own config file where this team's copy of nanoGPT is beside the checkout; else one with the same
# kind of assignments (a user's clone has no copy: the test then checks the same keys)
NANOGPT_CONFIG = SHARED.parent / "anchors" / "nanogpt" / "config" / "train_shakespeare_char.py"
SAME_KEYS = """out_dir = 'out-shakespeare-char'
eval_interval = 250
eval_iters = 200
log_interval = 10
always_save_checkpoint = False
wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt'
dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 64
block_size = 256
n_layer = 6
n_head = 6
n_embd = 384
dropout = 0.2
learning_rate = 1e-3
max_iters = 5000
lr_decay_iters = 5000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100
"""
SMALL = [*TINY, "--max_iters=4", "--eval_interval=2", "--eval_iters=2", "--device=cpu"]


@pytest.fixture
def nanogpt_folder(tmp_path):
    # a folder laid out as nanoGPT's checkout is: its config file, and data/shakespeare_char prepared its way
    config = NANOGPT_CONFIG.read_text() if NANOGPT_CONFIG.is_file() else SAME_KEYS
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "train_shakespeare_char.py").write_text(config)
    nanogpt_char_folder(tmp_path / "data" / "shakespeare_char", OWN_TEXT * 50)
    return tmp_path


def test_nanogpts_config_file_runs_as_it_is_and_eval_only_writes_nothing(nanogpt_folder):
    out = nanogpt_folder / "out-shakespeare-char"  # its out_dir, from the file, in the folder it runs in
    done = script("train.py", "config/train_shakespeare_char.py", *SMALL, cwd=nanogpt_folder)
    assert done.returncode == 0, done.stderr
    saved = torch.load(out / "ckpt.pt", weights_only=True)
    assert saved["config"]["data_dir"] == "data/shakespeare_char" and saved["config"]["dropout"] == 0.2
    assert saved["iter_num"] == 4
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    done = script("train.py", "config/train_shakespeare_char.py", *SMALL, "--eval_only=True", "--init_from=resume",
                  cwd=nanogpt_folder)
    assert done.returncode == 0, done.stderr
    assert "step 4: train loss" in done.stdout and "iter 5" not in done.stdout  # evaluated, nothing trained
    assert "note: eval_only=True evaluates once" in done.stdout and "ends the run" not in done.stdout  # (its schedule)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing written
    # its dataset= names a folder of data/; a --data_dir given beside it is the data the run reads
    shutil.copytree(nanogpt_folder / "data" / "shakespeare_char", nanogpt_folder / "elsewhere")
    done = script("train.py", "config/train_shakespeare_char.py", *SMALL, f"--out_dir={nanogpt_folder / 'out2'}",
                  f"--data_dir={nanogpt_folder / 'elsewhere'}", cwd=nanogpt_folder)
    assert done.returncode == 0, done.stderr
    assert torch.load(nanogpt_folder / "out2" / "ckpt.pt", weights_only=True)["config"]["data_dir"] == str(
        nanogpt_folder / "elsewhere")


def test_bias_false_is_this_model_and_bias_true_is_refused(nanogpt_folder):
    data = f"--data_dir={nanogpt_folder / 'data' / 'shakespeare_char'}"
    said = train_refusal(*SMALL, data, "--bias=True")
    assert said.startswith("bias=True: this model's blocks are Llama's") and "leave bias out" in said
    assert run(*SMALL, data, f"--out_dir={nanogpt_folder / 'o'}", "--bias=False").returncode == 0


def nanogpt_checkpoint(path):
    # a 1-layer model in nanoGPT's ckpt.pt format: its keys, its model_args (bias among them), GPT-2's weight names
    n_embd, vocab, block = 16, 65, 8
    h, wide = "transformer.h.0.", 4 * n_embd
    weights = {"transformer.wte.weight": torch.randn(vocab, n_embd),
               "transformer.wpe.weight": torch.randn(block, n_embd),
               h + "ln_1.weight": torch.ones(n_embd), h + "attn.c_attn.weight": torch.randn(3 * n_embd, n_embd),
               h + "attn.c_proj.weight": torch.randn(n_embd, n_embd), h + "ln_2.weight": torch.ones(n_embd),
               h + "mlp.c_fc.weight": torch.randn(wide, n_embd), h + "mlp.c_proj.weight": torch.randn(n_embd, wide),
               "transformer.ln_f.weight": torch.ones(n_embd), "lm_head.weight": torch.randn(vocab, n_embd)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": weights, "optimizer": {"state": {}, "param_groups": []},
                "model_args": dict(n_layer=1, n_head=2, n_embd=n_embd, block_size=block, bias=False, vocab_size=vocab,
                                   dropout=0.0),
                "iter_num": 100, "best_val_loss": torch.tensor(1.5),
                "config": {"dataset": "shakespeare_char", "batch_size": 12, "init_from": "scratch"}}, path)


def test_nanogpts_checkpoint_is_named_as_such_by_every_reader(nanogpt_folder):
    out = nanogpt_folder / "out-shakespeare-char"
    nanogpt_checkpoint(out / "ckpt.pt")
    data = f"--data_dir={nanogpt_folder / 'data' / 'shakespeare_char'}"
    said = {
        "train.py": train_refusal(*SMALL, data, f"--out_dir={out}", "--init_from=resume"),
        "sample.py": script("sample.py", f"--out_dir={out}", "--max_new_tokens=5").stderr,
        "eval.py": script("eval.py", f"--out_dir={out}").stderr,
        "export.py": script("export.py", f"--out_dir={out}", f"--to={nanogpt_folder / 'hf'}").stderr,
    }
    for name, line in said.items():
        assert "is nanoGPT's checkpoint (GPT-2 blocks" in line and "train here anew" in line, (name, line)
        assert len(line.strip().splitlines()) == 1, (name, line)
    assert not (nanogpt_folder / "hf").exists()


def test_gpt2_starting_points_say_what_to_start_from(nanogpt_folder):
    tmp_path = nanogpt_folder
    said = train_refusal(*SMALL, f"--data_dir={tmp_path / 'data' / 'shakespeare_char'}", "--init_from=gpt2",
                         f"--out_dir={tmp_path / 'o'}")
    assert "nanoGPT's 'gpt2' names OpenAI's GPT-2" in said and "Qwen3 folder" in said
    done = script("sample.py", "--init_from=gpt2-xl")
    assert done.returncode == 1 and "--init_from=gpt2-xl is not 'resume' or a Hugging Face model folder" in done.stderr
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "vocab_size": 64}))
    from lib.files import UserError
    from lib.hf import load_pretrained
    with pytest.raises(UserError, match="GPT-2's blocks .* are nanoGPT's, not this model's"):
        load_pretrained(folder)


def test_sample_takes_nanogpts_init_from_resume(nanogpt_folder):
    data = nanogpt_folder / "data" / "shakespeare_char"
    run(*SMALL, f"--data_dir={data}", f"--out_dir={nanogpt_folder / 'o'}")
    done = script("sample.py", "--init_from=resume", f"--out_dir={nanogpt_folder / 'o'}", "--num_samples=1",
                  "--max_new_tokens=20", "--start=First")
    assert done.returncode == 0 and done.stdout.startswith("First"), done.stderr
