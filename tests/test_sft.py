"""Supervised fine-tuning: conversations with loss masks, whole examples packed exactly (data.py), the loss over
the trained targets of an update however it is split, epochs, resume, sample.py --chat and export.py's chat files."""

import io
import json
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import prepare
from helpers import assert_weights_close, losses, run, script, train_refusal, weights
from lib.data import Split, best_fit
from lib.files import END, UserError
from model import GPT, GPTConfig, linear_cross_entropy

WORDS = "apple river stone cloud seven orange lamp tiger music paper green window silver forest quiet".split()
SMALL = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--batch_size=4", "--eval_iters=2",
         "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=40", "--learning_rate=3e-3", "--eval_interval=100",
         "--sequences=examples"]


def conversations(n, seed):
    # reverse a list of words: prompts and answers of mixed lengths, some with a system prompt, some two turns
    rng = np.random.default_rng(seed)
    for _ in range(n):
        messages = [{"role": "system", "content": "Reverse the words."}] if rng.random() < 0.3 else []
        for _ in range(1 + (rng.random() < 0.2)):
            words = list(rng.choice(WORDS, size=rng.integers(1, 9)))
            messages += [{"role": "user", "content": " ".join(words)},
                         {"role": "assistant", "content": " ".join(reversed(words))}]
        yield {"messages": messages}


def write_chat_data(folder):
    with open(folder / "chats.jsonl", "w") as f:
        for record in conversations(600, seed=0):
            f.write(json.dumps(record) + "\n")
    prepare.main([str(folder / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={folder / 'data'}"])


@pytest.fixture(scope="session")
def chat_data(shared):
    return shared("sft", write_chat_data) / "data"


@pytest.fixture(scope="session")
def scored_run(chat_data, shared):
    # 3 steps on the conversations, evaluated at the last: made once, only read by the tests that score its
    # checkpoint again (in process, with eval.py, with transformers) and compare with the val loss it logged
    return shared("sft_scored", lambda out: run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={out}",
                                                "--max_iters=3", "--eval_interval=3"))


def split(chat_data, name="train", block_size=64, seed=1):
    meta = json.loads((chat_data / "meta.json").read_text())
    return Split(str(chat_data), name, meta, block_size, seed, examples=True, vocab_size=meta["vocab_size"])


# -----------------------------------------------------------------------------
# packing, in-process


def test_best_fit_packs_every_example_once_within_the_capacity():
    rng = np.random.default_rng(0)
    sizes = np.minimum(rng.geometric(1 / 60, size=5000), 257).tolist()  # long-tailed, as chat sets are
    bins = best_fit(sizes, 257)
    assert sorted(i for b in bins for i in b) == list(range(5000))
    assert all(sum(sizes[i] for i in b) <= 257 for b in bins)
    assert sum(sizes) / (len(bins) * 257) > 0.95  # real tokens in the sequences (padded alone: ~23%)


def test_an_epoch_holds_every_example_once_in_an_order_of_its_own(chat_data):
    train = split(chat_data)
    n = len(train.lengths)
    assert n == json.loads((chat_data / "meta.json").read_text())["train"]["documents"]
    first, second = ([i for s in train.epoch(e) for i in s] for e in (0, 1))
    assert sorted(first) == sorted(second) == list(range(n)) and first != second
    assert split(chat_data).epoch(1) == train.epoch(1)  # the seed decides
    x, _, _ = train.packed(range(train.sequences_in(1) - 1, train.sequences_in(1) + 1))
    assert x[1].tolist() == train.packed([0, train.sequences_in(1)])[0][1].tolist()  # epoch 1 follows epoch 0


def test_packed_targets_are_the_masked_in_tokens_of_each_example_alone(chat_data):
    train = split(chat_data)
    tokens = np.fromfile(chat_data / "train.bin", dtype=np.uint16).astype(np.int64)
    mask = np.fromfile(chat_data / "train.mask.bin", dtype=np.uint8)
    x, y, doc_ids = train.packed(range(3))
    for row in range(3):
        at = 0
        for doc, example in enumerate(train.sequence(row)):
            start, whole = train.starts[example], train.lengths[example]
            assert tokens[start + whole - 1] == train.eot_id and mask[start + whole - 1] == END  # its marked end
            length = min(whole, 65)  # a longer one is cut to the sequence's 64 inputs and one more target
            ids = tokens[start:start + length]
            assert x[row, at:at + length].tolist() == ids[:len(x[row, at:at + length])].tolist()
            assert (doc_ids[row, at:at + length] == doc).all()
            want = np.where(mask[start + 1:start + length] == 1, ids[1:], -1)  # its own next tokens, if trained
            assert y[row, at:at + length - 1].tolist() == want.tolist()
            if at + length < 64:
                assert y[row, at + length - 1] == -1  # the next example's first token is no target
            at += length
        assert (y[row, at:] == -1).all()  # padding
    assert (y != -1).sum() > 0 and (y == -1).sum() > 0


def test_the_loss_of_packed_examples_is_that_of_each_alone(chat_data):
    # document masking makes packing exact: the summed loss of a packed row equals the sum of its examples' losses,
    # each run on its own, and its mean is over the trained targets only
    train = split(chat_data)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=320)).eval()
    for p in model.parameters():  # weights far from their small initial ones, so that attention matters
        torch.nn.init.normal_(p, std=0.3)
    row = next(n for n in range(100) if len(train.sequence(n)) >= 3)
    x, y, doc_ids = train.packed([row])
    with torch.no_grad():
        logits = model(x)[0]
        packed_loss = model(x, y, doc_ids=doc_ids)[1]
        alone, count = 0.0, 0
        for doc in doc_ids[0].unique().tolist():
            rows = (doc_ids[0] == doc).nonzero().flatten()
            if (y[0, rows] == -1).all():
                continue
            logits_alone = model(x[:, rows])[0][0]
            alone += F.cross_entropy(logits_alone, y[0, rows], ignore_index=-1, reduction="sum").item()
            count += (y[0, rows] != -1).sum().item()
        unmasked = F.cross_entropy(logits[0], y[0], ignore_index=-1).item()  # without the document mask
    assert packed_loss.item() == pytest.approx(alone / count, rel=1e-5)
    assert unmasked != pytest.approx(alone / count, rel=1e-3)  # attending across examples would change it


@pytest.mark.parametrize("op", ["reference", "triton"])
def test_ignored_targets_change_no_gradient(op):
    # rows whose target is -1 (masked out, padding) contribute nothing: changing their hidden states changes
    # neither the loss nor the head's gradient, and their own gradient is zero
    if op == "triton":
        kernels = pytest.importorskip("kernels")
        if not kernels.HAS_TRITON:
            pytest.skip("no Triton")
        fn = kernels.linear_cross_entropy
    else:
        fn = linear_cross_entropy
    torch.manual_seed(0)
    x, w = torch.randn(16, 32), torch.randn(96, 32)
    targets = torch.randint(0, 96, (16,))
    targets[::3] = -1
    results = []
    for hidden in (x, torch.where((targets == -1)[:, None], torch.randn(16, 32) * 5, x)):
        hidden, weight = hidden.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hidden, weight, targets)
        loss.backward()
        results.append((loss.detach(), weight.grad, hidden.grad))
    (loss_a, w_a, x_a), (loss_b, w_b, x_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(w_a, w_b)
    assert (x_a[targets == -1] == 0).all() and (x_a[targets != -1] != 0).any()


# -----------------------------------------------------------------------------
# train.py on conversations


@pytest.mark.slow  # SFT's quick checks: the chat sample and export, eval_full, a resume that moves the end
def test_examples_accumulated_match_one_big_batch_and_epochs_end_the_run(chat_data, tmp_path):
    # micro-batches hold different numbers of targets: each is weighted by its share of the update's, so that 4
    # micro-steps of 2 sequences give the update of one batch of 8
    # SGD for the weights' sake: AdamW amplifies rounding where a gradient is below eps (test_train's
    # test_gradient_accumulation_matches_one_big_batch says how much)
    common = [*SMALL, f"--data_dir={chat_data}", "--max_iters=6", "--optimizer=sgd"]
    run(*common, f"--out_dir={tmp_path / 'big'}", "--batch_size=8")
    run(*common, f"--out_dir={tmp_path / 'acc'}", "--batch_size=2", "--gradient_accumulation_steps=4")
    big, acc = losses(tmp_path / "big"), losses(tmp_path / "acc")
    assert big.keys() == acc.keys() == set(range(1, 7)) and all(abs(big[i] - acc[i]) < 1e-5 for i in big)
    assert_weights_close(weights(tmp_path / "big"), weights(tmp_path / "acc"))
    # two epochs: as many steps as their sequences take, then the run ends
    per_epoch = split(chat_data).sequences_in(2)
    out = run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'epochs'}", "--max_epochs=2",
              "--batch_size=16", "--max_iters=1000", "--warmup_ratio=0.1", "--eval_interval=1000")
    steps = -(-per_epoch // 16)
    assert f"max_epochs=2: {steps} steps (lr_decay_iters 40, warmup {-(-steps // 10)})" in out.stdout
    ckpt = torch.load(tmp_path / "epochs" / "ckpt.pt", weights_only=True)
    assert ckpt["iter_num"] == steps
    evals = [json.loads(line) for line in (tmp_path / "epochs" / "metrics.jsonl").read_text().splitlines()]
    assert evals[-1]["epoch"] == pytest.approx(2.0, abs=16 / per_epoch)
    # a resume with a third epoch: the last step's padding past the second was the third's first sequences, which
    # its steps (on from that step) never train: said (they had gone unsaid)
    two = split(chat_data, seed=1337).sequences_in(2)  # (the run's)
    batch = next(b for b in range(16, 32) if two % b)
    common = [*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'more'}", f"--batch_size={batch}",
              "--eval_interval=1000"]
    run(*common, "--max_epochs=2", "--max_iters=1000")
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "ckpt.pt").write_bytes((tmp_path / "more" / "ckpt.pt").read_bytes())
    said = f"warning: {batch - two % batch} sequences of the next epoch were padding in the checkpoint's last step " \
        f"(its max_epochs=2): they are not trained"
    assert said in run(*common, "--max_epochs=3", "--init_from=resume", f"--max_iters={-(-two // batch) + 1}").stdout
    # so on with max_epochs=0, the steps going on to max_iters; not where the run trains nothing more
    common[common.index(f"--out_dir={tmp_path / 'more'}")] = f"--out_dir={tmp_path / 'zero'}"
    assert said not in run(*common, "--init_from=resume", f"--max_iters={-(-two // batch)}").stdout
    assert said in run(*common, "--init_from=resume", f"--max_iters={-(-two // batch) + 1}").stdout


def test_val_loss_is_over_every_trained_token_of_the_val_split(chat_data, scored_run):
    record = [json.loads(line) for line in (scored_run / "metrics.jsonl").read_text().splitlines()][-1]
    from lib.trained import load_run
    model = load_run(str(scored_run / "ckpt.pt"))[0].eval()
    val = split(chat_data, "val", seed=1337)
    x, y, doc_ids = val.packed(range(val.sequences_in(1)))
    with torch.no_grad():
        total = sum(model(x[i:i + 1], y[i:i + 1], doc_ids=doc_ids[i:i + 1])[1].item() * (y[i] != -1).sum().item()
                    for i in range(len(x)))
    assert record["val_loss"] == pytest.approx(total / (y != -1).sum().item(), rel=1e-5)


def logged_val_loss(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()][-1]["val_loss"]


def eval_py_loss(out_dir, *args):
    done = script("eval.py", f"--out_dir={out_dir}", "--device=cpu", *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "each on its own" in lines[-2]  # it says what it scored
    return float(lines[-1].split()[2])


@pytest.mark.slow  # eval_full's scoring of conversations stays in the quick tier
def test_eval_py_scores_conversations_as_training_does(scored_run):
    # conversations are evaluated as they are trained: each val example on its own over its trained targets. eval.py
    # gives the val loss train.py logged for the same checkpoint (not windows across examples over every token),
    # in any batching
    logged = logged_val_loss(scored_run)
    assert eval_py_loss(scored_run) == pytest.approx(logged, rel=1e-5)
    assert eval_py_loss(scored_run, "--batch_size=3") == pytest.approx(logged, rel=1e-5)
    done = script("eval.py", f"--out_dir={scored_run}", "--device=cpu", "--stride=5")  # it had no effect, unsaid
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "eval.py: --stride is a setting of text's windows, and each example is scored on its own: leave it out"]


def test_eval_full_scores_conversations_as_training_does(chat_data, scored_run, tmp_path):
    # eval_full on conversations: each val example on its own, as without it, on a run of whole examples (the
    # shared run's settings); on a run of windows, the loss eval.py gives for its checkpoint
    full = run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'full'}", "--max_iters=3",
               "--eval_interval=3", "--eval_full=True", "--eval_stride=16")
    assert "val loss: each val example on its own" in full.stdout
    assert logged_val_loss(tmp_path / "full") == pytest.approx(logged_val_loss(scored_run), rel=1e-5)
    windows = [a for a in SMALL if a != "--sequences=examples"]
    run(*windows, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'win'}", "--max_iters=2", "--eval_interval=2",
        "--eval_full=True", "--eval_stride=16")
    assert eval_py_loss(tmp_path / "win") == pytest.approx(logged_val_loss(tmp_path / "win"), rel=1e-5)


@pytest.mark.slow
def test_the_logged_val_loss_of_conversations_is_transformers_example_by_example(chat_data, scored_run, tmp_path):
    # transformers on the export, example by example (each cut to block_size + 1 tokens as in training), over the
    # trained targets: the val loss train.py logged
    transformers = pytest.importorskip("transformers")
    logged = logged_val_loss(scored_run)
    done = script("export.py", f"--out_dir={scored_run}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    val = split(chat_data, "val", seed=1337)
    tokens = np.fromfile(chat_data / "val.bin", dtype=np.uint16).astype(np.int64)
    mask = np.fromfile(chat_data / "val.mask.bin", dtype=np.uint8)
    total, count = 0.0, 0
    with torch.no_grad():
        for start, length in zip(val.starts, np.minimum(val.lengths, 65)):
            ids, trained = tokens[start:start + length], mask[start + 1:start + length] == 1
            logits = theirs(torch.tensor(ids[None, :-1])).logits[0]
            targets = torch.tensor(np.where(trained, ids[1:], -100))
            total += F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            count += int(trained.sum())
    assert total / count == pytest.approx(logged, rel=1e-4)


@pytest.mark.slow
def test_examples_under_ddp_match_one_process_and_resume_exactly(chat_data, tmp_path):
    common = [*SMALL, f"--data_dir={chat_data}", "--batch_size=2", "--gradient_accumulation_steps=2",
              "--max_epochs=1", "--eval_interval=4", "--max_iters=8"]
    run(*common, f"--out_dir={tmp_path / 'one'}")
    run(*common, f"--out_dir={tmp_path / 'ddp'}", torchrun=["--standalone", "--nproc_per_node=2"])
    one, ddp = losses(tmp_path / "one"), losses(tmp_path / "ddp")
    assert one.keys() == ddp.keys() == set(range(1, 9)) and all(abs(one[i] - ddp[i]) < 1e-5 for i in one)
    assert_weights_close(weights(tmp_path / "one"), weights(tmp_path / "ddp"))
    # with dropout, stopped in the middle of the epoch at step 4, then resumed: the same losses and weights as
    # the run that never stopped, bit for bit
    run(*common, "--dropout=0.1", f"--out_dir={tmp_path / 'whole'}")
    run(*common, "--dropout=0.1", f"--out_dir={tmp_path / 'parts'}", "--max_iters=4")
    run(*common, "--dropout=0.1", f"--out_dir={tmp_path / 'parts'}", "--init_from=resume")
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")
    assert_weights_close(weights(tmp_path / "whole"), weights(tmp_path / "parts"), atol=0)


def test_chat_sample_and_export_stop_at_the_end_of_turn(chat_data, tmp_path, monkeypatch):
    run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=30", "--eval_interval=30")
    done = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=apple river", "--temperature=0",
                  "--max_new_tokens=20", "--device=cpu", "--system=Reverse the words.")
    assert done.returncode == 0, done.stderr
    # the same reply by hand: the conversation rendered as in training, greedy, cut at the end-of-turn
    from lib.chat import ChatFormat
    from lib.trained import load_run
    model, tokenizer, _ = load_run(str(tmp_path / "run" / "ckpt.pt"))
    meta = json.loads((chat_data / "meta.json").read_text())
    assert meta["chat"]["end_of_turn_id"] == tokenizer.eot_id  # the built-in template closes turns with it
    fmt = ChatFormat.for_tokenizer(str(chat_data), tokenizer.special_tokens(), "<|endoftext|>")
    text = fmt.render([{"role": "system", "content": "Reverse the words."}, {"role": "user", "content": "apple river"}],
                      add_generation_prompt=True)
    assert text.endswith("<|user|>\napple river\n<|assistant|>\n")
    ids = tokenizer.encode_chat(text, [])[0].tolist()
    out = model.eval().generate(torch.tensor([ids]), 20, temperature=0)[0, len(ids):].tolist()
    out = out[:out.index(tokenizer.eot_id)] if tokenizer.eot_id in out else out
    assert done.stdout.strip() == tokenizer.decode(out).strip()
    empty = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start= ", "--device=cpu")
    assert empty.returncode == 1 and empty.stderr.startswith("sample.py: --start is empty: give the message")
    many = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=apple river", "--num_samples=2")
    assert many.returncode == 1 and "--num_samples is plain sampling's: --chat gives one reply" in many.stderr
    # the system prompt read from a file (--system=FILE:), as --start's: the same reply
    (tmp_path / "system.txt").write_text("Reverse the words.")
    read = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=apple river", "--temperature=0",
                  "--max_new_tokens=20", "--device=cpu", f"--system=FILE:{tmp_path / 'system.txt'}")
    assert read.returncode == 0 and read.stdout == done.stdout, read.stderr
    # read as prepare.py reads text: line endings as they are, a BOM (Notepad's) no character of it
    (tmp_path / "prompt.txt").write_bytes(b"\xef\xbb\xbfapple\r\nriver\r\n")
    read = script("sample.py", f"--out_dir={tmp_path / 'run'}", f"--start=FILE:{tmp_path / 'prompt.txt'}",
                  "--temperature=0", "--max_new_tokens=1", "--device=cpu")
    assert read.returncode == 0 and read.stdout.startswith("apple\r\nriver\r\n"), (read.stdout, read.stderr)
    # a special token's spelling in a message would be read as the token (here the end of the turn): refused in one
    # line; typed, it is said and the next message asked for; Ctrl-C at the prompt ends the chat, no traceback
    for bad, said in [("--start=apple <|endoftext|> river", "--start"), ("--system=Be <|endoftext|>", "--system")]:
        refused = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--device=cpu", bad,
                         *[] if bad.startswith("--start") else ["--start=apple river"])
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"{said} holds <|endoftext|>, a special token of the tokenizer, as text" in refused.stderr

    class Typed(io.StringIO):  # the lines typed, then Ctrl-C
        def readline(self, *args):
            line = super().readline(*args)
            if not line:
                raise KeyboardInterrupt
            return line
    monkeypatch.setattr(sys, "stdin", Typed("apple <|endoftext|> river\napple river\n"))
    typed = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0", "--max_new_tokens=20",
                   "--device=cpu", "--system=Reverse the words.")
    assert typed.returncode == 0 and typed.stdout == f"> > {done.stdout}> \n", typed.stdout
    assert typed.stderr.startswith("the message holds <|endoftext|>") and typed.stderr.count("\n") == 1
    monkeypatch.setattr(sys, "stdin", Typed('caf\udce9\n"""apple\ncaf\udce9\nriver"""\napple river\n'))  # bytes not
    # UTF-8, alone or in a pasted message: said once a message, the whole of it left out, and the next asked for
    typed = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0", "--max_new_tokens=20",
                   "--device=cpu", "--system=Reverse the words.")
    assert typed.returncode == 0 and typed.stdout == f"> > ... ... > {done.stdout}> \n", typed.stdout
    assert typed.stderr == "the message is not UTF-8 text: type it in UTF-8\n" * 2
    # a message past block_size with the system prompt: said, as a plain prompt past it is
    long = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=" + "apple river " * 60,
                  "--max_new_tokens=2", "--device=cpu", "--system=Reverse the words.")
    assert long.returncode == 0 and "of which the model sees the last" in long.stderr, long.stderr
    assert long.stderr.strip().endswith("(its block_size): the system prompt is cut off")
    long = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=" + "apple river " * 60,
                  "--max_new_tokens=2", "--device=cpu")
    assert long.returncode == 0 and long.stderr.strip().endswith("(its block_size): its beginning is cut off")

    def interrupted(*args, **kwargs):  # Ctrl-C while it samples: no traceback, the status a shell gives SIGINT
        raise KeyboardInterrupt
    with monkeypatch.context() as patched:
        patched.setattr(GPT, "generate", interrupted)
        stopped = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--start=apple", "--device=cpu")
        asked = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--start=apple", "--device=cpu")
    assert stopped.returncode == asked.returncode == 130 and stopped.stdout == asked.stdout == "\n"
    assert stopped.stderr == asked.stderr == ""
    # a conversation typed: each reply is to the whole of it, the system prompt, the messages and replies before
    seen, generate = [], GPT.generate
    with monkeypatch.context() as patched:
        patched.setattr(GPT, "generate", lambda self, x, *a, **kw: seen.append(x[0].tolist()) or generate(self, x, *a,
                                                                                                         **kw))
        patched.setattr(sys, "stdin", Typed("apple river\nstone cloud\n"))
        typed = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0",
                       "--max_new_tokens=4", "--device=cpu", "--system=Reverse the words.")
    first = typed.stdout.split("\n")[0].removeprefix("> ")
    history = [{"role": "system", "content": "Reverse the words."}, {"role": "user", "content": "apple river"},
               {"role": "assistant", "content": first}, {"role": "user", "content": "stone cloud"}]
    assert typed.returncode == 0 and len(seen) == 2, typed.stdout + typed.stderr
    assert seen[1] == tokenizer.encode_chat(fmt.render(history, add_generation_prompt=True), [])[0].tolist()
    # a message of several lines, an empty one among them, between """ and """: one message, as --start's
    monkeypatch.setattr(sys, "stdin", Typed('"""apple\n\nriver"""\n'))
    typed = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0", "--max_new_tokens=20",
                   "--device=cpu", "--system=Reverse the words.")
    started = script("sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0", "--max_new_tokens=20",
                     "--device=cpu", "--system=Reverse the words.", "--start=apple\n\nriver")
    assert typed.returncode == started.returncode == 0 and typed.stdout == f"> ... ... {started.stdout}> \n"
    # export: the template and the end-of-turn token as generation's eos go along
    done = script("export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert generation["eos_token_id"][0] == meta["chat"]["end_of_turn_id"]
    assert config["chat_template"] == meta["chat"]["template"] and config["split_special_tokens"] is False
    gguf = pytest.importorskip("gguf")
    done = script("export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'model.gguf'}")
    assert done.returncode == 0, done.stderr
    fields = gguf.GGUFReader(tmp_path / "model.gguf").fields
    assert fields["tokenizer.ggml.eos_token_id"].contents() == meta["chat"]["end_of_turn_id"]
    # llama.cpp renders the template with its BOS's and EOS's text (the end of turn here; where the file names no BOS,
    # a default: ","): it renders as the data was, whatever they are
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    messages = [{"role": "user", "content": "apple river"}, {"role": "assistant", "content": "river apple"}]
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        fields["tokenizer.chat_template"].contents())
    assert template.render(messages=messages, bos_token=",", eos_token=",") == fmt.render(messages)
    transformers = pytest.importorskip("transformers")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert theirs == fmt.render(messages)
    assert hf_tokenizer(theirs, add_special_tokens=False)["input_ids"] == tokenizer.encode_chat(theirs, [])[0].tolist()


@pytest.mark.slow
def test_plain_sampling_of_a_doc_mask_run_on_conversations_keeps_the_conversation_past_a_turns_end(tmp_path):
    # under doc_mask a document began where the mask marks an example's end, not at the end-of-text that closes a turn
    # (the built-in template's): sample.py keeps the context there, as the run attended (it dropped it at every one)
    rng = np.random.default_rng(0)
    with open(tmp_path / "chats.jsonl", "w") as f:  # replies a model learns to end in a few steps
        for _ in range(300):
            words = list(rng.choice(WORDS, size=rng.integers(1, 6)))
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words)},
                                             {"role": "assistant", "content": f"ok {words[0]}"}]}) + "\n")
    prepare.main([str(tmp_path / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'data'}"])
    run(*SMALL, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=40",
        "--eval_interval=40", "--lr_decay_iters=40", "--doc_mask=True")
    from lib.trained import load_run
    model, tokenizer, _ = load_run(str(tmp_path / "run" / "ckpt.pt"))
    prompt = f"<|user|>\n{' '.join(WORDS[:3])}\n<|assistant|>\n"
    ids = torch.tensor([tokenizer.encode(prompt, bos=True)])

    def samples(**extra):  # as sample.py draws them: one seed, then a sample after another
        torch.manual_seed(0)
        return [model.eval().generate(ids, 60, temperature=1.0, vocab=tokenizer.vocab_size, **extra)[0, ids.shape[1]:].tolist() for _ in range(5)]
    kept, reset = samples(), samples(document=tokenizer.eot_id)
    assert any(tokenizer.eot_id in k and k != r for k, r in zip(kept, reset))  # they part after an end-of-text
    done = script("sample.py", f"--out_dir={tmp_path / 'run'}", f"--start={prompt}", "--temperature=1", "--top_k=0",
                  "--seed=0", "--num_samples=5", "--max_new_tokens=60", "--device=cpu")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n---------------\n")[:5] == [prompt + tokenizer.decode(k) for k in kept]


def test_sample_and_export_refuse_another_tokenizers_data_in_one_line(chat_data, tmp_path):
    # --data_dir made with another tokenizer (the same conversations, another vocabulary): its ids would mean other
    # words, so sample.py, export.py and eval.py refuse it in one line, as train.py does; the run's own data is taken
    data_dir = tmp_path / "other"
    prepare.main([str(chat_data.parent / "chats.jsonl"), "--tokenizer=bpe:280", f"--out_dir={data_dir}"])
    run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1", "--eval_interval=1")
    commands = [("sample.py", "--start=apple", "--max_new_tokens=2", "--num_samples=1"),
                ("export.py", f"--to={tmp_path / 'hf'}"), ("eval.py",)]
    for command in commands:
        done = script(*command, f"--out_dir={tmp_path / 'run'}", f"--data_dir={data_dir}")
        assert done.returncode != 0 and done.stderr.count("\n") == 1, (command, done.stderr)
        assert (f"{data_dir} was not prepared with the tokenizer {tmp_path / 'run' / 'ckpt.pt'} was trained with "
                f"(its ids would mean other words): leave --data_dir out") in done.stderr
    assert not (tmp_path / "hf").exists()
    done = script("sample.py", "--start=apple", "--max_new_tokens=2", "--num_samples=1",
                  f"--out_dir={tmp_path / 'run'}", f"--data_dir={chat_data}")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_conversations_from_parquet_and_json_are_those_of_jsonl(tmp_path):
    # the same records as JSON Lines, a JSON array and a parquet table (messages: a list of structs) make the
    # same tokens and masks
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    records = list(conversations(40, seed=2))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "b.json").write_text(json.dumps(records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c.parquet")
    made = []
    for name in ("a.jsonl", "b.json", "c.parquet"):
        out = tmp_path / f"data-{name}"
        meta = prepare.main([str(tmp_path / name), "--tokenizer=bpe:300", f"--out_dir={out}", "--val_fraction=0"])
        assert meta["masks"] and meta["train"]["documents"] == 40 and meta["bad_records"]["count"] == 0
        made.append([(out / f).read_bytes() for f in ("train.bin", "train.mask.bin")])
    assert made[0] == made[1] == made[2]


def test_a_parquet_conversation_has_the_keys_of_its_record_not_its_tables(tmp_path):
    # a parquet table gives each message every key any message has (None where it had none): a template that asks
    # whether one is defined renders the records as their JSON Lines do
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    records = list(conversations(6, seed=3))
    records[0]["messages"][0]["name"] = "bob"
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "b.parquet")
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %} ({{ m.name }}){% endif %}: "
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
        "{% else %}{{ m.content }}\n{% endif %}{% endfor %}")
    made = []
    for name in ("a.jsonl", "b.parquet"):
        out = tmp_path / f"data-{name}"
        prepare.main([str(tmp_path / name), "--tokenizer=bpe:300", f"--out_dir={out}", "--val_fraction=0",
                      f"--chat_template={tmp_path / 't.jinja'}"])
        made.append([(out / f).read_bytes() for f in ("train.bin", "train.mask.bin")])
    assert made[0] == made[1]


def test_sharegpt_conversations_are_those_of_messages_in_files_and_hub_datasets(tmp_path, monkeypatch):
    # ShareGPT's layout ({"conversations": [{"from": "human", "value": ...}]}, its roles mapped to the template's)
    # makes the very tokens and masks of the same conversations as messages, from a file and from an hf: dataset;
    # a turn of a role it does not know is a bad record that says what it wanted
    from test_prepare import hub_folder
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    records = list(conversations(40, seed=5))
    names = [{"system": "system", "user": "human", "assistant": "gpt"}, {"user": "user", "assistant": "assistant"}]
    shared = [{"id": n, "conversations": [{"from": names[n % 2].get(m["role"], m["role"]), "value": m["content"]}
                                          for m in r["messages"]]} for n, r in enumerate(records)]
    (tmp_path / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shared) +
                                             json.dumps({"conversations": [{"from": "bot", "value": "hi"}]}) + "\n")
    made = []
    for source in (tmp_path / "messages.jsonl", tmp_path / "sharegpt.jsonl",
                   f"hf:{hub_folder(tmp_path / 'hub', {'train': shared})}"):
        out = tmp_path / f"data-{len(made)}"
        meta = prepare.main([str(source), "--tokenizer=bpe:300", f"--out_dir={out}", "--val_fraction=0"])
        assert meta["masks"] and meta["train"]["documents"] == 40
        made.append([(out / f).read_bytes() for f in ("train.bin", "train.mask.bin")])
    assert made[0] == made[1] == made[2]
    assert meta["bad_records"]["count"] == 0 and "conversations 1 is not a turn with a 'from' (human/user/gpt/" \
        "assistant/system/tool) and a text 'value'" in json.loads((tmp_path / "data-1" / "meta.json").read_text())[
        "bad_records"]["examples"][0]


@pytest.mark.slow
def test_data_prepared_again_is_noted_by_a_resume_and_another_template_refused_by_sample_and_export(chat_data,
                                                                                                   tmp_path):
    # The run's folder prepared again with the same tokenizer (a model's tokenizer.json): other splits change the
    # sequences a resume goes on through (said in a note); another chat template is not the one the run's
    # conversations were made with, so sample.py and export.py refuse it in one line rather than chat through it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tokenizer.train_from_iterator(WORDS * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    def prepare_again(colons, *args):
        template.write_text("{% for m in messages %}{{ m.role }}" + ":" * colons + " {{ m.content }}<|endoftext|>"
                            "{% endfor %}")
        prepare.main([str(chat_data.parent / "chats.jsonl"), f"--tokenizer={tmp_path / 'tokenizer.json'}",
                      f"--out_dir={data}", "--overwrite", f"--chat_template={template}", *args])
    data, out, template = tmp_path / "data", tmp_path / "run", tmp_path / "t.jinja"
    prepare_again(1)
    common = [*SMALL, f"--data_dir={data}", f"--out_dir={out}", "--eval_interval=1"]
    run(*common, "--max_iters=1")
    prepare_again(1, "--val_fraction=0.3")
    done = run(*common, "--max_iters=2", "--init_from=resume")
    assert f"note: {data} was prepared again since {out / 'ckpt.pt'} was saved (its splits' sizes differ)" in done.stdout
    assert "prepared again" not in run(*common, "--max_iters=3", "--init_from=resume").stdout  # (as it was saved)
    prepare_again(2, "--val_fraction=0.3")
    for command in [("sample.py", "--start=apple", "--max_new_tokens=2"), ("export.py", f"--to={tmp_path / 'hf'}")]:
        done = script(*command, f"--out_dir={out}")
        assert done.returncode != 0 and done.stderr.count("\n") == 1, (command, done.stderr)
        assert f"{data} was prepared with another chat template than the run's conversations" in done.stderr
    assert not (tmp_path / "hf").exists()

def test_a_template_that_hides_the_replies_selects_nothing_and_is_refused(tmp_path):
    # the mask must never silently select nothing: a template that does not write the assistant's replies is
    # refused in one line before anything is written
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in conversations(20, seed=3)))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
                        "<|endoftext|>{% endfor %}")
    with pytest.raises(UserError, match="does not write an assistant's reply") as stopped:
        prepare.main([str(tmp_path / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'data'}",
                      f"--chat_template={template}"])
    assert "\n" not in str(stopped.value) and not (tmp_path / "data").exists()


@pytest.mark.slow
def test_every_epoch_kept_and_a_run_resumed_from_one_ends_the_same(chat_data, tmp_path):
    # save_every_epoch: ckpt_epoch_N.pt at the step that finishes epoch N; copied into a fresh out_dir as
    # ckpt.pt, it continues to the very weights of the run that never stopped, saving epoch 2's end on the way
    # before it has evaluated once (eval_interval=100)
    common = [*SMALL, f"--data_dir={chat_data}", "--batch_size=16", "--max_iters=1000", "--max_epochs=3",
              "--save_every_epoch=True", "--dropout=0.1"]
    run(*common, f"--out_dir={tmp_path / 'whole'}")
    per_epoch = split(chat_data).sequences_in(1)
    ends = {n: -(-split(chat_data).sequences_in(n) // 16) for n in (1, 2, 3)}  # the step that finishes epoch n
    for n, step in ends.items():
        assert torch.load(tmp_path / "whole" / f"ckpt_epoch_{n}.pt", weights_only=True)["iter_num"] == step
    assert per_epoch > 16  # an epoch spans several steps
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts" / "ckpt.pt").write_bytes((tmp_path / "whole" / "ckpt_epoch_1.pt").read_bytes())
    out = run(*common, f"--out_dir={tmp_path / 'parts'}", "--init_from=resume")
    assert f"iter {ends[1] + 1}:" in out.stdout and f"iter {ends[1]}:" not in out.stdout
    assert torch.load(tmp_path / "parts" / "ckpt_epoch_2.pt", weights_only=True)["iter_num"] == ends[2] < ends[3]
    assert_weights_close(weights(tmp_path / "whole"), weights(tmp_path / "parts"), atol=0)


def test_a_message_holding_the_end_of_text_marker_is_skipped(tmp_path):
    # "<|endoftext|>" inside a message would read as the token that ends an example and cut it in two
    records = list(conversations(10, seed=4))
    records[3]["messages"][-2]["content"] += " <|endoftext|> and more"
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare.main([str(tmp_path / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'data'}"])
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'chats.jsonl'}:4: it holds <|endoftext|>, which ends an "
                                               f"example in the token files, as text"]
    assert meta["train"]["documents"] + meta["val"]["documents"] == 9


@pytest.mark.slow
def test_a_resume_that_moves_the_end_says_so(chat_data, tmp_path):
    common = [*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*common, "--max_iters=2")
    out = run(*common, "--max_iters=3", "--init_from=resume")
    assert "note: max_iters is 3, not the checkpoint's 2: the run ends at step 3; lr_decay_iters, the schedule's " \
        "length, is 40" in out.stdout
    assert "note: max_iters is" not in run(*common, "--max_iters=3", "--init_from=resume").stdout  # nothing moved
    behind = run(*common, "--max_iters=1", "--init_from=resume")  # an end before the checkpoint's step
    assert "note: max_iters=1 is behind the checkpoint's step 3: nothing is trained (raise max_iters to train on)" \
        in behind.stdout and "run ended at step 3" in behind.stdout and "iter 4" not in behind.stdout


def test_an_empty_reply_is_skipped_as_the_records_fault_not_the_templates(tmp_path):
    records = list(conversations(10, seed=4))
    records[3]["messages"][-1]["content"] = " "
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare.main([str(tmp_path / "chats.jsonl"), "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'data'}"])
    n = len(records[3]["messages"])
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'chats.jsonl'}:4: assistant message {n} is empty: there "
                                               f"is no reply to learn from"]
    # a prompt/completion record of strings: its completion
    pairs = [{"prompt": f"Question {i}?", "completion": " " if i == 2 else f" Answer {i}."} for i in range(10)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    meta = prepare.main([str(tmp_path / "pairs.jsonl"), "--tokenizer=bpe:300", f"--out_dir={tmp_path / 'pairs'}"])
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'pairs.jsonl'}:3: the completion is empty: there is no "
                                               f"reply to learn from"]


def test_examples_cut_to_nothing_trained_are_refused(chat_data, tmp_path):
    # block_size 6: every example is cut before its answer, and no target is left: refused, not a silent loss of 0;
    # at 8 a few training examples keep some, but no validation one does
    train = split(chat_data, block_size=6)
    assert train.targets[0] == 0 < train.targets[1] == int((np.fromfile(chat_data / "train.mask.bin", np.uint8) == 1).sum())
    assert 0 < split(chat_data, block_size=8).targets[0] < split(chat_data).targets[0] < train.targets[1]
    assert split(chat_data, block_size=1000).targets[0] == train.targets[1]
    for block, name in ((6, "train"), (8, "val")):  # train.py's checks, in process (helpers.train_refusal)
        said = train_refusal(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / name}", f"--block_size={block}")
        assert f"no {name} example keeps a trained token within its first block_size + 1 = {block + 1} tokens" in said
    # val examples cut too are said, as train's are: their loss leaves the cut targets out
    out = run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'cut'}", "--block_size=24", "--max_iters=1")
    val = split(chat_data, "val", block_size=24)
    assert 0 < val.cut and f"val loss: each val example on its own, over its trained targets ({val.cut} longer than " \
        f"block_size + 1 = 25 tokens, cut to it, keeping {val.targets[0] / val.targets[1]:.1%}" in out.stdout
    done = script("eval.py", f"--out_dir={tmp_path / 'cut'}", "--device=cpu")  # eval.py's score of it says so too
    assert f"; {val.cut} longer than block_size + 1 = 25 tokens, cut to it, keeping" in done.stdout


@pytest.mark.parametrize("config", ["sft_qwen3.py", "sft_qwen3_full.py"])
def test_the_sft_configs_evaluation_costs_a_small_share_of_the_run(config):
    # the train loss's estimate (eval_iters micro-batches, forward only) against the steps between two evaluations
    # (each micro-batch forward and backward, about three forwards): under 2% (eval_iters=50 took 95 s against
    # ~4 s a step on a CPU)
    from helpers import ROOT, train_settings
    settings = train_settings([ROOT / "config" / config])  # the defaults, then the file, as train.py takes them
    evaluation = settings["eval_iters"] * settings["batch_size"]
    training = settings["eval_interval"] * settings["batch_size"] * settings["gradient_accumulation_steps"] * 3
    assert evaluation / training < 0.02, evaluation / training


@pytest.mark.slow  # a 200-step run and two sample.py Pythons: ~55 s
def test_a_chat_past_block_size_leaves_out_its_oldest_exchanges(chat_data, tmp_path):
    # a conversation longer than block_size=64: the window slid into the middle of a turn, the system prompt and the
    # generation prompt's start cut off, and the reply was to a text unlike any the model learned. The oldest exchanges
    # are left out instead: a last message whose earlier turns cannot fit is answered as it would be alone
    import subprocess
    import sys
    from helpers import ROOT
    run(*SMALL, f"--data_dir={chat_data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=200", "--eval_interval=200",
        "--lr_decay_iters=200")
    chat = [sys.executable, "sample.py", f"--out_dir={tmp_path / 'run'}", "--chat", "--temperature=0",
            "--max_new_tokens=8", "--device=cpu", "--system=Reverse the words."]
    earlier = "apple river stone cloud seven orange lamp tiger\nmusic paper green window silver forest quiet\n"
    talk = subprocess.run(chat, input=earlier + "lamp tiger\n\n", cwd=ROOT, capture_output=True, text=True)
    alone = subprocess.run([*chat, "--start=lamp tiger"], cwd=ROOT, capture_output=True, text=True)
    assert talk.returncode == alone.returncode == 0, talk.stderr + alone.stderr
    assert talk.stdout.split("> ")[3].strip() == alone.stdout.strip()
