"""
Measurements. By default, train.py's throughput once per value of a setting (eager against torch.compile):
median tokens/s, ms/iter and MFU of the steps after warmup, and peak memory:

    python bench.py config/train_small.py
    python bench.py config/train_gpt2.py --synthetic --compare=use_kernels --steps=30
    python bench.py config/train_small.py --compare=optimizer --values=adamw,muon,adam,sgd

--mode=race gives every run the same --seconds of training (its schedule ending there) and reports the val loss
reached. --run names a whole set of overrides per run instead (each optimizer wants its own learning rate):

    python bench.py config/train_shakespeare_char_cpu.py --mode=race --seconds=20 --compare=lr_schedule \
        --values=cosine,wsd
    python bench.py config/train_small.py --mode=race --seconds=120 \
        --run="--optimizer=adamw" --run="--optimizer=muon" --run="--optimizer=sgd --learning_rate=0.3"
--mode=seeds runs --seeds seeds of nanoGPT's own CPU "baby" Shakespeare-char run (its train.py unchanged, only its
seed moved), then of a recipe, at --threads threads on the same data, each scored over the whole val split.
NANOGPT_CLONE: `git clone https://github.com/karpathy/nanoGPT`, data made by its data/shakespeare_char/prepare.py:

    python bench.py config/train_shakespeare_char_cpu.py --mode=seeds --nanogpt=NANOGPT_CLONE \
        --data_dir=NANOGPT_CLONE/data/shakespeare_char
    python bench.py --mode=kernels   # each fused op of kernels.py against its references (GPU)
    python bench.py --mode=load      # peak memory of load_pretrained on a generated ~1 GB folder
    python bench.py --mode=lora      # memory of full fine-tuning, LoRA and QLoRA of a Qwen3-0.6B shape
    python bench.py --mode=memory config/train_gpt2.py   # memory per GPU on 1, 8 and 64 of them, estimated
    python bench.py --mode=encode --tokenizer=gpt2       # prepare.py's throughput against tiktoken's own
    python bench.py --mode=gpu --out=gpu      # all a GPU must show, for BENCHMARKS.md (--tiny: on CPU)
    python bench.py --mode=gpu --section=step --out=gpu   # one part alone: gpu/step.md, line by line
    python bench.py --mode=gpu --section=versus --nanogpt=NANOGPT_CLONE --out=gpu   # beside nanoGPT, profiled

--synthetic trains on random tokens; any other --key=value goes to train.py (prepare.py under --mode=encode).
"""

import argparse
import os

from benchmarks.modes import MODES
from lib.files import UserError, one_line_errors


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)  # --seed is train.py's, not short for --seeds
    add = parser.add_argument
    add("--compare", default="compile", help="a setting of train.py to run with each of --values")
    add("--values", default="False,True", help="comma-separated values of --compare")
    add("--run", action="append", help="instead of --compare: --run='--key=value ...', once per run")
    add("--seconds", type=float, default=60, help="--mode=race: training seconds per run")
    add("--nanogpt", help="--mode=seeds and --mode=gpu --section=versus: a folder of nanoGPT's code (train.py, "
        "model.py, configurator.py, config/), run unchanged")
    add("--seeds", type=int, help="--mode=seeds: runs of our recipe, seeds 1 to N (default 5; 2 with --tiny)")
    add("--threads", type=int, default=len(os.sched_getaffinity(0)), help="--mode=seeds: threads of every run")
    add("--steps", type=int, default=50, help="training steps per run")
    add("--warmup", type=int, default=10, help="first steps left out of the medians")
    add("--synthetic", action="store_true", help="random tokens (vocab 50257) instead of data_dir")
    add("--mode", choices=list(MODES), default="train", help="race: equal wall time per run; seeds: a recipe's "
        "seeds against nanoGPT's run, the whole val split; kernels: time kernels.py's ops; load: memory of loading "
        "a Hugging Face folder; lora: memory of full, LoRA and QLoRA fine-tuning; memory: a config's memory per GPU "
        "on 1, 8 and 64 GPUs, estimated without a GPU; encode: prepare.py's throughput against tiktoken's batch "
        "encoder; gpu: all a GPU must show, as Markdown for BENCHMARKS.md")
    add("--tiny", action="store_true", help="--mode=gpu at tiny shapes on a CPU, --mode=seeds and --mode=load at "
                                            "tiny ones: a smoke check")
    add("--section", default="all", help="--mode=gpu: the parts of the report to run, comma-separated: versus, "
        "race, kernels, step, memory, optimizers, finetune, tests (docs/measuring.md, 'Measuring on a GPU')")
    add("--out", help="--mode=gpu: a folder for each section's Markdown (SECTION.md), written as it goes")
    add("--commit", help="--mode=gpu: the commit the report names (default: git describe, else the "
                         "wheels/COMMIT that wheels.py writes)")
    add("--minutes", type=float, default=6.5, help="--mode=gpu: no row begins after this many minutes, so that a "
        "run under a time limit ends with every row it began")
    args, train_args = parser.parse_known_args()
    if args.warmup < 0 or not 0 < args.seconds < float("inf"):
        raise UserError(f"--warmup={args.warmup} must be at least 0 and --seconds={args.seconds:g} above 0 and finite")
    varied = [f"--{args.compare}=", *(a for run in args.run or () for a in run.split())]
    sets = {"train": "eval_iters", "race": "lr_decay_iters"}.get(args.mode)  # (measure.run_train's, beside these)
    compared = tuple(f"--{key}=" for key in (sets, "eval_interval", "log_interval", "always_save_checkpoint"))
    # its own come after the user's, and win: the steps and the folder wherever given, the rest where compared
    taken = [a for a in [*train_args, *varied] if sets and a.startswith(("--max_iters=", "--out_dir="))] + \
        [a for a in varied if sets and a.startswith(compared)]
    if taken:
        raise UserError(f"{taken[0].partition('=')[0]}: bench.py sets it, running --steps steps (--mode=race: as many "
                        f"as --seconds hold, to the end of the schedule) with one evaluation, in a folder it removes; "
                        f"give --steps")
    if overridden := [a.partition("=")[0] for a in train_args if sets and a.startswith(compared)]:  # (copied commands)
        print(f"note: {', '.join(overridden)}: bench.py's own, in place of this command's (one evaluation, at the end)")
    if (args.seeds is not None and args.seeds < 1) or args.threads < 1:
        raise UserError(f"--seeds={args.seeds} and --threads={args.threads} must be at least 1")
    if args.warmup >= args.steps:
        raise UserError(f"--warmup={args.warmup} leaves no steps to measure of --steps={args.steps}")
    return args, train_args


def main():
    one_line_errors("bench.py")
    args, train_args = parse_args()
    MODES[args.mode](args, train_args)


if __name__ == "__main__":
    main()
