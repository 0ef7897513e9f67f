"""
What a checkpoint costs on this machine's disk, at GPT-2 small's shape (124M parameters, AdamW's two moments: a
1.4 GiB file): the save of ckpt.pt with ckpt_best.pt and one step checkpoint beside it, each a file of its own
(checkpoint.copy_file: a clone where the file system makes one, else a copy) against hard links to one file, in
turn in one process; and the read of it, the CRC-32 check (resume.check_crcs) against torch.load alone.

    python benchmarks/checkpoint_save.py --dir=/tmp --repeats=3
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lib import checkpoint as ckpt  # noqa: E402
from lib import resume  # noqa: E402
from lib.optim import build_optimizers  # noqa: E402
from lib.settings import defaults  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402


def hard_link(src, dst):  # what a save's extra names were: one file under several names
    os.link(src, dst)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a folder on the disk to measure")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024))
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw"}, "cpu")
    x = torch.randint(0, 50304, (1, 64))
    model(x, x)[1].backward()
    optimizers[0].step()
    times = {"files of their own": ([], ckpt.copy_file), "hard links": ([], hard_link)}
    for repeat in range(args.repeats):
        for name, (seconds, copy) in times.items():
            folder = tempfile.mkdtemp(dir=args.dir)
            ckpt.copy_file = copy
            began = time.perf_counter()
            ckpt.save(folder, {"iter_num": 1 + repeat, "model_args": {}, "config": {}}, model, optimizers,
                      sharded=False, lora=False, improved=True, keep_last_n=2)
            seconds.append(time.perf_counter() - began)
            path = os.path.join(folder, "ckpt.pt")
            size = os.path.getsize(path)
            if name == "files of their own":
                began = time.perf_counter()
                resume.check_crcs(path)
                checked = time.perf_counter() - began
                began = time.perf_counter()
                resume.load_checkpoint(path, verify=False)
                print(f"read: CRC-32s checked in {checked:.2f} s, torch.load alone {time.perf_counter() - began:.2f} s")
            shutil.rmtree(folder)
    print(f"ckpt.pt: {size / 2**30:.2f} GiB; a save with ckpt_best.pt and one step checkpoint:")
    for name, (seconds, _) in times.items():
        print(f"  {name}: median {sorted(seconds)[len(seconds) // 2]:.2f} s ({', '.join(f'{s:.2f}' for s in seconds)})")


if __name__ == "__main__":
    main()
