"""
Sample from a trained model: its checkpoint, and the tokenizer of the data it was trained on.

    python sample.py --out_dir=out-small --start="import " --num_samples=2 --max_new_tokens=200
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt --temperature=0.8
"""

import argparse
import os
import sys
from contextlib import nullcontext

import torch

from model import GPT, GPTConfig, load_checkpoint
from prepare import load_tokenizer

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out_dir", default="out", help="folder holding the checkpoint")
parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint file in out_dir (ckpt_best.pt: best val loss)")
parser.add_argument("--start", default="\n", help="prompt text, or FILE:path to read it from a file")
parser.add_argument("--num_samples", type=int, default=3)
parser.add_argument("--max_new_tokens", type=int, default=500)
parser.add_argument("--temperature", type=float, default=0.8, help="<1 is surer, >1 more varied, 0 greedy")
parser.add_argument("--top_k", type=int, default=200, help="sample only among the k likeliest tokens")
parser.add_argument("--top_p", type=float, default=None, help="sample only among tokens whose mass reaches p")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--data_dir", default=None, help="the dataset whose tokenizer to use (default: the model's own)")
parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'mps'")
parser.add_argument("--dtype", default="auto", help="'float32', 'bfloat16', 'float16'; auto: bf16 on CUDA")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# the checkpoint, the model and the tokenizer

def fail(msg):
    sys.exit(f"sample.py: {msg}")


device = args.device
if device == "auto":
    device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
if device.startswith("cuda") and not torch.cuda.is_available():
    fail(f"--device={device} but no CUDA GPU is visible (use --device=cpu)")
if args.top_k is not None and args.top_k < 1:
    fail(f"--top_k={args.top_k} must be at least 1 (or leave it out)")
dtype = args.dtype
if dtype == "auto":
    dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
path = os.path.join(args.out_dir, args.ckpt)
if not os.path.exists(path):
    fail(f"no checkpoint at {path} (train first: python train.py ..., or pass --out_dir)")
try:
    checkpoint = load_checkpoint(path, device)
except ValueError as e:
    fail(str(e))
if not isinstance(checkpoint, dict) or {"model", "model_args", "config"} - checkpoint.keys():
    fail(f"{path} is not a checkpoint of train.py (it lacks its model, model_args or config)")
model = GPT(GPTConfig(**checkpoint["model_args"]))
model.load_state_dict(checkpoint["model"])
model.eval().to(device)
# the tokenizer lives with the data the model was trained on: where it was then, or here
candidates = [args.data_dir] if args.data_dir else [checkpoint.get("data_dir"), checkpoint["config"]["data_dir"]]
data_dir = next((d for d in candidates if d and os.path.isdir(d)), None)
if data_dir is None:
    fail(f"the model was trained on {candidates[-1]}, which is not here: sample.py needs its tokenizer "
         f"(restore it, or pass --data_dir)")
if os.path.exists(os.path.join(data_dir, "prepare.incomplete")):
    fail(f"{data_dir} is a dataset prepare.py did not finish (re-run prepare.py)")
try:
    tokenizer = load_tokenizer(data_dir)
except (ValueError, KeyError, TypeError) as e:
    fail(f"cannot read the tokenizer in {data_dir} ({type(e).__name__}: {e}); re-run prepare.py")
if tokenizer.vocab_size > model.config.vocab_size:
    fail(f"{data_dir}'s tokenizer has {tokenizer.vocab_size} tokens, more than the model's {model.config.vocab_size}: "
         f"it is not the data this model was trained on")

start = args.start
if start.startswith("FILE:"):
    try:
        with open(start[5:], encoding="utf-8") as f:
            start = f.read()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"cannot read the prompt file {start[5:]} ({e})")
try:
    ids = tokenizer.encode(start)
except ValueError as e:  # e.g. a character the char vocabulary lacks
    fail(f"the prompt cannot be encoded: {e}")
if not ids:
    fail("the prompt encodes to no tokens (give a non-empty --start)")

# -----------------------------------------------------------------------------
# generate

torch.manual_seed(args.seed)
x = torch.tensor(ids, dtype=torch.long, device=device)[None, :]  # (1, T)
autocast = nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))
with autocast:
    for _ in range(args.num_samples):
        y = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
        print(tokenizer.decode(y[0].tolist()))
        print("---------------")
