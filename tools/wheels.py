"""
The wheels a GPU machine without a package index lacks, fetched here into wheels/ (ignored by git) to be
copied there with the checkout (docs/measuring.md, "A GPU machine without a package index"); and wheels/COMMIT, the commit that bench.py's
report names there, where a copy of the project has no .git.

    python tools/wheels.py                   # for the GPU machine: Python 3.12 on x86-64 Linux
    python tools/wheels.py --python=3.11 --out=wheels311

There, without an index:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl && export PYTHONPATH=/tmp/site
and, for GPT-2's encoding (bench.py --section=race): export TIKTOKEN_CACHE_DIR=$PWD/wheels/tiktoken_cache
"""

import argparse
import os
import subprocess
import sys

# What the project uses and the GPU machine's image lacks (its package list: torch 2.11, Triton 3.6,
# transformers, peft, huggingface-hub, pyarrow, pandas, xxhash, fsspec are there). torchao 0.18 is the one
# built for torch 2.11; dill and multiprocess are what datasets needs beyond the image. tensorboard is listed
# in the image too, but fetched so that its test runs whichever image a machine has (5.5 MB). wandb is left
# out: only wandb_log=True imports it, and it would add ~20 MB to what is copied.
WHEELS = ["rustbpe==0.1.0", "torchao==0.18.0", "gguf==0.19.0", "datasets==5.2.0", "dill==0.4.1",
          "multiprocess==0.70.19", "tensorboard==2.21.0"]
# pip matches a wheel's manylinux tag exactly, so every glibc level the wheels above are built for is named
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
CARRY_LIMIT = 64 * 2**20  # a copy of the checkout and its wheels kept small: warned about past half of this


def fetch(out, python):
    # pip download of each wheel alone (--no-deps: the image has the rest), binary only, for the target Python
    platforms = [flag for p in PLATFORMS for flag in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--implementation",
           "cp", "--python-version", python, *platforms, "-d", out, *WHEELS]
    if subprocess.run(cmd).returncode:
        sys.exit("wheels.py: pip download failed (above): check that the package index is reachable")


def fetch_gpt2(out):
    # tiktoken's GPT-2 files, for bench.py --section=race there (TIKTOKEN_CACHE_DIR=wheels/tiktoken_cache): it
    # cannot download them
    os.environ["TIKTOKEN_CACHE_DIR"] = os.path.join(out, "tiktoken_cache")
    import tiktoken
    tiktoken.get_encoding("gpt2")


def write_commit(out):
    # the commit (and -dirty for uncommitted changes) of this checkout, for bench.py's report on the machine
    git = ["git", "describe", "--always", "--dirty"]
    done = subprocess.run(git, capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    if done.returncode == 0:
        with open(os.path.join(out, "COMMIT"), "w") as f:
            f.write(done.stdout.strip() + "\n")
    return done.stdout.strip() or "unknown (not a git checkout)"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="wheels", help="the folder (ignored by git) the wheels go to")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    fetch(args.out, args.python)
    fetch_gpt2(args.out)
    commit = write_commit(args.out)
    files = sorted(f for f in os.listdir(args.out) if f.endswith(".whl"))
    total = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
    for f in files:
        print(f"{os.path.getsize(os.path.join(args.out, f)) / 2**20:6.1f} MB  {f}")
    print(f"{total / 2**20:6.1f} MB in {len(files)} wheels in {args.out}/, commit {commit}")
    if total > CARRY_LIMIT // 2:
        print(f"warning: the wheels take over {CARRY_LIMIT // 2**21} MiB: copying them with each checkout is slow")


if __name__ == "__main__":
    main()
