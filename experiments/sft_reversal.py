"""
An ablation, not a measurement: what the assistant-only mask buys on a task whose answers are known (reverse
3-5 of 30 words), in exact match on held-out prompts after the same --steps, trained on the answers only and on
every token; and the real tokens of packed sequences on a chat set of long-tailed lengths, against one example
per sequence. BENCHMARKS.md quotes it. Run it from the repository's root (it runs prepare.py and train.py there);
any other --key=value goes to train.py:

    python -m experiments.sft_reversal --steps=300
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

from lib.data import Split
from lib.files import UserError, one_line_errors, read_meta
from lib.trained import load_run

WORDS = ("ant bee cat dog eel fox gnu hen ibis jay kite lynx mole newt owl pig quail rat seal toad urchin vole wasp "
         "yak zebra crab dove frog goat hare").split()  # about one bpe:512 token each


def reversal_chats(path, n, rng, seen, lengths=(3, 5)):
    # n conversations "reverse: a b c" -> "c b a", none in seen (nor repeated); their words lists returned
    made = []
    while len(made) < n:
        pick = tuple(rng.choice(WORDS, size=rng.integers(lengths[0], lengths[1] + 1)))
        if pick not in seen:
            seen.add(pick)
            made.append(pick)
    with open(path, "w") as f:
        for pick in made:
            f.write(json.dumps({"messages": [{"role": "user", "content": "reverse: " + " ".join(pick)},
                                             {"role": "assistant", "content": " ".join(reversed(pick))}]}) + "\n")
    return made


def exact_match(out_dir, prompts):
    # greedy answers to the held-out prompts, cut at the end-of-turn, against the truth
    model, tokenizer, _ = load_run(os.path.join(out_dir, "ckpt.pt"))
    right = 0
    for pick in prompts:
        text = f"<|user|>\nreverse: {' '.join(pick)}\n<|assistant|>\n"  # the built-in template's prompt
        ids = tokenizer.encode_chat(text, [])[0].tolist()
        out = model.eval().generate(torch.tensor([ids]), 16, temperature=0, stop=tokenizer.eot_id)[0, len(ids):]
        out = out.tolist()
        right += tokenizer.decode(out[:out.index(tokenizer.eot_id)] if tokenizer.eot_id in out else out) == \
            " ".join(reversed(pick))
    return right / len(prompts)


def run_script(cmd):
    # prepare.py or train.py with these arguments; its output's end when it fails
    done = subprocess.run([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise UserError(f"{cmd[0]} failed:\n{done.stdout[-3000:]}")


def masks_compared(tmp, steps, train_args, rng):
    # (trained on, val loss, exact match on the held-out prompts) for the answers only, then every token
    seen = set()
    shape = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=128", "--batch_size=16", "--device=cpu",
             "--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=50", f"--lr_decay_iters={steps}",
             f"--max_iters={steps}", f"--eval_interval={steps}", "--sequences=examples", *train_args]
    reversal_chats(os.path.join(tmp, "train.jsonl"), 4000, rng, seen)
    held_out = reversal_chats(os.path.join(tmp, "test.jsonl"), 200, rng, seen)
    rows = []
    for train_on in ("assistant", "all"):
        data, out = os.path.join(tmp, f"data_{train_on}"), os.path.join(tmp, f"out_{train_on}")
        run_script(["prepare.py", os.path.join(tmp, "train.jsonl"), "--val_input", os.path.join(tmp, "test.jsonl"),
                    "--tokenizer=bpe:512", f"--train_on={train_on}", f"--out_dir={data}"])
        run_script(["train.py", f"--data_dir={data}", f"--out_dir={out}", *shape])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            val_loss = [json.loads(line) for line in f][-1]["val_loss"]
        rows.append((train_on, val_loss, exact_match(out, held_out)))
    return rows


def packing(tmp, rng):
    # answers of 5-300 words (tokens), log-normal lengths (median ~30), in sequences of 256: (conversations, share
    # of real tokens packed, share with one example per sequence)
    with open(os.path.join(tmp, "mixed.jsonl"), "w") as f:
        for _ in range(3000):
            n = int(np.clip(np.round(np.exp(rng.normal(np.log(30), 1.0))), 5, 300))
            prompt, answer = rng.choice(WORDS, size=rng.integers(3, 21)), rng.choice(WORDS, size=n)
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(prompt)},
                                             {"role": "assistant", "content": " ".join(answer)}]}) + "\n")
    data = os.path.join(tmp, "data_mixed")
    subprocess.run([sys.executable, "prepare.py", os.path.join(tmp, "mixed.jsonl"), "--tokenizer=bpe:512",
                    f"--out_dir={data}"], stdout=subprocess.DEVNULL, check=True)
    train = Split(data, "train", read_meta(data), 256, 1337, examples=True, vocab_size=2**31)
    real = np.minimum(train.lengths, 257).sum()
    return len(train.lengths), real / (train.sequences_in(1) * 257), real / (len(train.lengths) * 257)


def main():
    one_line_errors("experiments/sft_reversal.py")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run")
    args, train_args = parser.parse_known_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = masks_compared(tmp, args.steps, train_args, rng)
        conversations, packed, padded = packing(tmp, rng)
    print(f"reverse 3-5 words: 4,000 conversations, 200 held out, {args.steps} steps each")
    print("| trained on | val loss (its own targets) | exact match, held out |\n| --- | --- | --- |")
    for train_on, val_loss, match in rows:
        print(f"| {train_on} | {val_loss:.4f} | {match:.1%} |")
    print(f"packing {conversations:,} conversations of long-tailed lengths into sequences of 256: real "
          f"tokens {packed:.1%} packed, {padded:.1%} one example per sequence ({packed / padded:.2f}x)")


if __name__ == "__main__":
    main()
