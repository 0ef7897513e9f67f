"""
bench.py --mode=gpu: everything a GPU must show (BENCHMARKS.md, "Not yet measured"), made of bench.py's measurements at a
GPU's shapes, in sections that run alone (--section), each a few minutes long, so that they fit a time limit a
few at a time. With --out=DIR each section writes DIR/SECTION.md line by line, so that a run stopped at its limit
still leaves what it finished; no row begins after --minutes. A row that cannot run (out of memory,
flash-attn or torchao not installed) is one line, and the rest go on. --tiny runs the same at tiny shapes on a
CPU, a smoke check of the command, without torch.compile (its first compile costs ~20 s a graph on a CPU).

    python bench.py --mode=gpu --out=gpu
    python bench.py --mode=gpu --section=step --out=gpu   # one part alone: gpu/step.md, line by line

docs/measuring.md, "Measuring on a GPU", says which sections go together, their times on an H100, and how a machine
without a package index gets the wheels it lacks (tools/wheels.py).
"""

import contextlib
import datetime
import importlib.util
import io
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import types

import numpy as np
import torch

import kernels
from benchmarks import measure
from benchmarks.measure import (QWEN3_06B, bench_lora, kernel_cases, kernel_table, matmul_peak, nanogpt_command,
                                nanogpt_model, nanogpt_module, out_of_time, planned_model, profiled_step, run_ours,
                                run_train, split_loss, throughput, timed_run)
from lib.files import UserError
from lib.memory import memory_estimate
from lib.parallel import peak_flops
from model import GPT, GPTConfig, flash_attn_func
from lib.optim import build_optimizers
from lib.settings import defaults

SECTIONS = ("versus", "race", "kernels", "step", "memory", "optimizers", "finetune", "tests")
GPT2_124M = [measure.in_checkout("config/train_gpt2.py"), "--batch_size=16", "--gradient_accumulation_steps=1",
             "--eval_iters=10"]
NEAR_1B = [*GPT2_124M, "--n_layer=20", "--n_head=32", "--n_kv_head=8", "--n_embd=2048", "--batch_size=8"]
LLAMA2_7B = dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008,
                 tie_embeddings=False)
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=2", "--eval_iters=2",
        "--gradient_accumulation_steps=1", "--device=cpu", "--compile=False"]
TINY_QWEN3 = dict(QWEN3_06B, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, head_size=32, mlp_hidden=128,
                  vocab_size=512)


def attempt(label, measure_fn, *a, **kw):
    # one row's measurement, or one line saying why there is none: a train.py that fails raises UserError, caught
    # here so that the rest go on
    if out_of_time(label):
        return None
    try:
        return measure_fn(*a, **kw)
    except UserError as e:
        print(f"| {label} | failed: {str(e).strip().splitlines()[-1][:200]} |")


@contextlib.contextmanager
def written_to(path):
    # what print() writes goes to the terminal and, given a path, to that file too, each write flushed: a run
    # stopped early still has every line written before it
    if path is None:
        yield
        return
    terminal = sys.stdout
    with open(path, "w") as f:
        def write(text):
            for stream in (terminal, f):
                stream.write(text)
                stream.flush()
        with contextlib.redirect_stdout(types.SimpleNamespace(write=write, flush=terminal.flush)):
            yield


@contextlib.contextmanager
def scratch_folder(section):
    # a section's temporary files, in a folder of a fixed name removed at its end and at its start: a run
    # stopped at its limit leaves its files behind, and a 7B folder fills a small disk for the next run
    folder = os.path.join(tempfile.gettempdir(), f"bench-gpu-{section}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def documents(folder, vocab=50257):
    # random GPT-2 tokens with an end-of-text every ~500 (what doc_mask cuts documents at), and their meta.json:
    # enough for speed and memory, where nothing needs to be learned
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        tokens = rng.integers(0, vocab - 1, size=2_000_000, dtype=np.uint16)
        tokens[rng.random(tokens.size) < 1 / 500] = vocab - 1
        tokens.tofile(os.path.join(folder, f"{split}.bin"))
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": vocab, "eot_id": vocab - 1}, f)


def stdlib_tokens(folder, tiny):
    # learnable text: prepare.py's default corpus, the machine's own Python standard library, in a BPE learned
    # from it (GPT-2's encoding is a download that a machine without a network cannot make); --tiny: the json
    # package alone
    data = os.path.join(folder, "stdlib")
    corpus = [os.path.join(sysconfig.get_paths()["stdlib"], "json")] if tiny else []
    cmd = [sys.executable, measure.in_checkout("prepare.py"), *corpus, f"--tokenizer=bpe:{512 if tiny else 8192}",
           f"--out_dir={data}"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise UserError(f"prepare.py failed:\n{done.stdout[-3000:]}")
    return data


def without_flash_attn(folder):
    # The environment of a train.py that cannot import flash-attn, so that model.py attends with SDPA as it does
    # on a machine without it: a module of that name, first on the path, that refuses to be imported.
    hidden = os.path.join(folder, "no_flash_attn")
    os.makedirs(hidden, exist_ok=True)
    with open(os.path.join(hidden, "flash_attn.py"), "w") as f:
        f.write('raise ImportError("hidden by bench.py --section=step, to measure SDPA")\n')
    return {"PYTHONPATH": os.pathsep.join(filter(None, [hidden, os.environ.get("PYTHONPATH")]))}


def report_commit(commit):
    # --commit, else git describe in a checkout, else the file wheels.py wrote beside the wheels it fetched
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: benchmarks/..
    if commit:
        return commit
    if shutil.which("git") and os.path.exists(os.path.join(here, ".git")):
        git = ["git", "describe", "--always", "--dirty"]  # the commit, and -dirty for uncommitted changes
        return subprocess.run(git, capture_output=True, text=True, cwd=here).stdout.strip() or "unknown"
    if os.path.exists(os.path.join(here, "wheels", "COMMIT")):
        with open(os.path.join(here, "wheels", "COMMIT")) as f:
            return f.read().strip() + " (wheels/COMMIT)"
    return "unknown (pass --commit=)"


def gpu_header(cuda, section, commit):
    triton = kernels.triton.__version__ if kernels.HAS_TRITON else "not installed"
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores, tiny shapes (--tiny)"
    print(f"## {datetime.date.today()}, GPU: {device} (python bench.py --mode=gpu --section={section})\n")
    print(f"torch {torch.__version__}, Triton {triton}, CUDA {torch.version.cuda}, "
          f"commit {report_commit(commit)}\n")

# -----------------------------------------------------------------------------
# the sections: each is called with (cuda, its scratch folder, bench.py's arguments, the arguments for train.py)


# nanoGPT's shape, its defaults (GPT-2 124M, bf16, compile) at 16 x 1024 tokens a step; --tiny: a tiny one on a CPU
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304, dropout=0.0)
VERSUS = dict(batch_size=16, block_size=1024)
VERSUS_TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=2)
RACE_ACCUMULATION = 4  # micro-steps an update in the race, both sides: 64K tokens, hundreds of updates in minutes
LEFT_OUT = "left out: name a nanoGPT checkout to run beside ours, --nanogpt=DIR (its train.py, unchanged)"


def both_args(shape, cuda, accumulation):
    # the settings nanoGPT's train.py and ours both take, at shape
    run_args = [f"--{k}={v}" for k, v in shape.items()] + [f"--gradient_accumulation_steps={accumulation}"]
    return run_args + (["--compile=True"] if cuda else ["--device=cpu", "--compile=False"])


def nanogpt_args(run_args):
    return [*run_args, "--dtype=float32"] if "--device=cpu" in run_args else run_args  # its CPU default: float16


def past_first_third(values):
    return statistics.median(values[len(values) // 3:])  # the first third holds the compile and the warm-up


def nanogpt_speed(nanogpt, data, folder, run_args, steps):
    # nanoGPT's train.py with run_args for steps on data -> (median ms a step, its peak MB or None); its times are
    # the `time X ms` of its log lines, one a step
    run_args = [*nanogpt_args(run_args), f"--max_iters={steps}", f"--lr_decay_iters={steps}", "--eval_interval=100000",
                "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False"]
    done = subprocess.run(nanogpt_command(nanogpt, data, folder, run_args), cwd=folder, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    times = [float(t) for t in re.findall(r"^iter \d+: .*time ([\d.]+)ms", done.stdout, re.M)]
    if done.returncode or not times:
        raise UserError(f"nanoGPT's train.py failed:\n{done.stdout[-3000:]}")
    peak = re.search(r"^peak memory (\d+) MB", done.stdout, re.M)
    return past_first_third(times), float(peak[1]) if peak else None


def our_speed(data, folder, run_args, steps):
    # our train.py (config/train_gpt2.py, then run_args) for steps on data -> (median ms a step, its peak MB)
    run_args = [measure.in_checkout("config/train_gpt2.py"), f"--data_dir={data}", *run_args, "--warmup_iters=1",
                f"--lr_decay_iters={steps}"]
    records = [r for r in run_train(run_args, folder, steps) if "ms_per_iter" in r]
    return past_first_third([r["ms_per_iter"] for r in records]), max(r["mem_mb"] for r in records)


def versus_profiles(nanogpt, config, batch_size, cuda, out):
    # one training step of each model alone in this process, timed and profiled: (label, ms, peak MB, where the
    # profile went: a file under out, or this output where there is no --out)
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    tokens = [torch.randint(0, 50257, (batch_size, config["block_size"] + 1), device=device) for _ in range(4)]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    ng = nanogpt_module(nanogpt)

    def theirs():
        with contextlib.redirect_stdout(io.StringIO()):  # what it prints of itself is not a line of this report
            model = ng.GPT(ng.GPTConfig(bias=False, **config)).to(device)
            return model, model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device)

    def ours():
        model = GPT(GPTConfig(**config)).to(device)
        return model, build_optimizers(model, {**defaults(), "optimizer": "adamw", "learning_rate": 6e-4,
                                               "weight_decay": 0.1}, device)[0]

    # each side built in its turn and freed after it, weights and optimizer state: a peak holds one model alone
    for label, short, build in [("nanoGPT's model", "nanogpt", theirs), ("our model, defaults", "ours", ours)]:
        model, optimizer = build()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        ms, peak, table = profiled_step(model, optimizer, batches, 30 if cuda else 3, compile=cuda)
        where = f"versus-profile-{short}.txt"
        if out:
            with open(os.path.join(out, where), "w") as f:
                f.write(f"{label}: one training step, {ms:.2f} ms\n{table}")
        else:
            print(f"{label}:\n\n```\n{table}```\n")
        del model, optimizer
        if cuda:
            torch.cuda.empty_cache()
        yield label, ms, peak, where if out else "above"


def section_versus(cuda, scratch, args, train_args):
    # nanoGPT's own train.py (from --nanogpt, run unchanged) and ours at nanoGPT's shape, on the same random GPT-2
    # tokens in nanoGPT's layout (which train.py reads too), for the same steps; then one step of each model alone,
    # under torch.profiler
    print("### Against nanoGPT at its shape: its train.py and ours, the same tokens and steps\n")
    if not args.nanogpt or not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        return print(LEFT_OUT)
    nanogpt, shape = os.path.abspath(args.nanogpt), VERSUS if cuda else VERSUS_TINY
    config = {**GPT2_SMALL, **{k: v for k, v in shape.items() if k != "batch_size"}}  # the model's, not the step's
    run_args = both_args(shape, cuda, 1)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 50257, size=4_000_000 if cuda else 200_000, dtype=np.uint16).tofile(f"{scratch}/{split}.bin")
    tokens = shape["batch_size"] * config["block_size"]
    with torch.device("meta"):
        flops = GPT(GPTConfig(**config)).flops_per_token() * tokens  # a step's, in PaLM's convention
    rate = peak_flops("cuda" if cuda else "cpu", torch.bfloat16)
    print(f"{' '.join(run_args)}, {args.steps} steps, medians past the first third; MFU in PaLM's convention, the "
          f"same arithmetic for both, against {(rate or 0) / 1e12:.3g} TFLOP/s\n")
    print("| run | ms/step | tokens/s | against nanoGPT | MFU | peak memory MB |\n" + "| --- " * 6 + "|")
    runs = [("nanoGPT's train.py", None), ("ours, defaults", [])]
    runs += [(f"ours, --use_kernels={k}", [f"--use_kernels={k}"]) for k in (False, True)]
    base = None
    for i, (label, extra) in enumerate(runs):
        if extra is None:
            row = attempt(label, nanogpt_speed, nanogpt, scratch, f"{scratch}/nanogpt", run_args, args.steps)
        else:
            row = attempt(label, our_speed, scratch, f"{scratch}/ours{i}", [*run_args, *train_args, *extra], args.steps)
        if row is None:
            continue
        ms, peak = row
        base = ms if extra is None else base  # nanoGPT's, where it ran
        against, mfu = f"{base / ms:.2f}x" if base else "n/a", f"{flops / ms * 1000 / rate:.1%}" if rate else "n/a"
        print(f"| {label} | {ms:.2f} | {tokens / ms * 1000:,.0f} | {against} | {mfu} | "
              f"{'n/a' if peak is None else f'{peak:,.0f}'} |")
    print("\nOne training step of each model alone in this process (forward, backward, clipping, AdamW; nothing "
          "else on the host), and torch.profiler's 15 costliest ops over three more steps\n")
    print("| model | ms/step | peak memory MB | profile |\n" + "| --- " * 4 + "|")
    for label, ms, peak, where in versus_profiles(nanogpt, config, shape["batch_size"], cuda, args.out):
        print(f"| {label} | {ms:.2f} | {'n/a' if math.isnan(peak) else f'{peak:,.0f}'} | {where} |")


def gpt2_stdlib(folder, tiny):
    # the race's real corpus: this Python's standard library (prepare.py's default; --tiny: its json package) in
    # GPT-2 tokens, nanoGPT's vocabulary, in the layout both trainers read -> its folder
    data = os.path.join(folder, "stdlib_gpt2")
    corpus = [os.path.join(sysconfig.get_paths()["stdlib"], "json")] if tiny else []
    done = subprocess.run([sys.executable, measure.in_checkout("prepare.py"), *corpus, "--tokenizer=gpt2",
                           f"--out_dir={data}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise UserError((done.stdout.strip().splitlines() or ["prepare.py failed"])[-1])
    return data


def race_model(side, nanogpt, data, folder, run_args):
    # one side's run to its end -> its final model
    if side == "ours":
        return run_ours([measure.in_checkout("config/train_gpt2.py"), f"--data_dir={data}", *run_args], folder, None)[1]
    cmd = nanogpt_command(nanogpt, data, folder, [*nanogpt_args(run_args), "--always_save_checkpoint=True"])
    timed_run(cmd, folder, None, "nanoGPT's train.py")
    return nanogpt_model(nanogpt, os.path.join(folder, "out", "ckpt.pt"))


def section_race(cuda, scratch, args, train_args):
    # nanoGPT (its defaults: 124M, AdamW 6e-4) and ours (config/train_gpt2.py) for the same training time
    # (--seconds) on the same real corpus, each with as many updates as its own speed fits in that time, its
    # schedule ended there; then each final model's loss over the whole val split, by the same code for both
    print(f"### The race: nanoGPT and ours for {args.seconds:g} s of training each, on real text\n")
    if not args.nanogpt or not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        return print(LEFT_OUT)
    data = attempt("data", gpt2_stdlib, scratch, tiny=not cuda)
    if data is None:
        return print("(the race needs GPT-2's encoding: without a network, bring tiktoken's files (tools/wheels.py) "
                     "and set TIKTOKEN_CACHE_DIR)")
    nanogpt, shape = os.path.abspath(args.nanogpt), VERSUS if cuda else VERSUS_TINY
    run_args, device = both_args(shape, cuda, RACE_ACCUMULATION), "cuda" if cuda else "cpu"
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)
    print(f"{' '.join(run_args)}; {os.path.getsize(os.path.join(data, 'train.bin')) // 2:,} train and {len(val):,} "
          f"val tokens; each timed on {args.steps} steps first, its warm-up then a tenth of its steps\n")
    print("| run | ms/step | steps | training s | val loss, whole split |\n" + "| --- " * 5 + "|")
    for side in ("nanoGPT", "ours"):
        timing_folder = f"{scratch}/{side}_timing"
        if side == "nanoGPT":
            side_args = run_args
            timing = attempt(side, nanogpt_speed, nanogpt, data, timing_folder, side_args, args.steps)
        else:
            side_args = [*run_args, *train_args]
            timing = attempt(side, our_speed, data, timing_folder, side_args, args.steps)
        if timing is None:
            continue
        steps = max(1, round(args.seconds * 1000 / timing[0]))
        warmup = min(max(1, steps // 10), steps - 1)  # below the decay's end: nanoGPT's cosine divides by the gap
        fitted = [f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--warmup_iters={warmup}",
                  f"--eval_interval={steps}", "--eval_iters=1"]
        model = attempt(side, race_model, side, nanogpt, data, f"{scratch}/{side}", [*side_args, *fitted])
        if model is None:
            continue
        model.to(device)
        logits = (lambda x: model(x, x)[0]) if side == "nanoGPT" else (lambda x: model(x)[0])
        loss = split_loss(logits, val, shape["block_size"], batch=8 if cuda else 64, device=device)
        print(f"| {side} | {timing[0]:.1f} | {steps} | {steps * timing[0] / 1000:.1f} | {loss:.4f} |")
        del model
        shutil.rmtree(f"{scratch}/{side}", ignore_errors=True)


def section_kernels(cuda, scratch, args, train_args):
    print("### Fused kernels against eager and compiled references (bf16)\n")
    if not kernels.HAS_TRITON:
        print("Triton is not installed (pip install triton): no kernels to measure")
        return
    # one size of those --mode=kernels covers, and both vocabularies, to keep the section within its minutes:
    # each reference compiles anew for every size
    sizes = dict(tokens=(32768,), widths=(4096,))
    if not cuda:
        sizes = dict(tokens=(64,), widths=(256,), vocabs=(512,))
    kernel_table(kernel_cases("cuda" if cuda else "cpu", **sizes), "cuda" if cuda else "cpu", compiled=cuda)


def step_runs(cuda, scratch):
    # (label, train.py's arguments, environment) of each row of section_step
    on = [f"--compile={cuda}", "--use_kernels=True"]
    runs = [(f"kernels {k}, {'compiled' if c else 'eager'}", [f"--use_kernels={k == 'on'}", f"--compile={c}"],
             None) for c in sorted({False, cuda}) for k in ("off", "on")]
    sdpa = without_flash_attn(scratch)
    if flash_attn_func is None:  # the run with the kernels on is SDPA's already
        print("flash-attn is not installed here (pip install flash-attn): attention is SDPA's in the runs above "
              "doc_mask's\n")
    else:
        runs += [("flash-attn", on, None), ("SDPA, causal", on, sdpa)]
    runs.append(("SDPA or FlexAttention (CUDA), doc_mask", [*on, "--doc_mask=True"], sdpa))
    return runs


def section_step(cuda, scratch, args, train_args):
    # tokens/s, MFU and peak memory of a step: the kernels and compile on and off, flash-attn against SDPA,
    # doc_mask's FlexAttention against plain causal SDPA
    print(f"### GPT-2 124M training step ({args.steps} steps, medians after {args.warmup})\n")
    documents(scratch)
    shape = [*train_args, *(GPT2_124M if cuda else TINY), f"--data_dir={scratch}"]
    runs = step_runs(cuda, scratch)
    datasheet, measured = peak_flops("cuda" if cuda else "cpu", torch.bfloat16), matmul_peak(cuda)
    print(f"MFU in PaLM's convention (every query against all T keys, as nanoGPT and nanochat report it) and of "
          f"the FLOPs run (causal; within documents under doc_mask), against the datasheet's peak "
          f"({(datasheet or 0) / 1e12:.3g} TFLOP/s); the last column against the {measured / 1e12:.3g} TFLOP/s "
          f"a {'bf16' if cuda else 'fp32'} matmul reaches here\n")
    print("| run | tokens/s | ms/iter | MFU PaLM | MFU run | MFU PaLM, measured peak | peak memory MB |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for i, (label, extra, env) in enumerate(runs):
        result = attempt(label, throughput, [*shape, *extra], f"{scratch}/step{i}", args.steps, args.warmup,
                         env=env)
        if result:
            med, mem = result
            mfus = [f"{med[k]:.1%}" if med[k] else "n/a" for k in ("mfu", "mfu_run")]
            mfus.append(f"{med['mfu'] * datasheet / measured:.1%}" if med["mfu"] and datasheet else "n/a")
            print(f"| {label} | {med['tokens_per_s']:,.0f} | {med['ms_per_iter']:.1f} | {' | '.join(mfus)} | "
                  f"{mem:,.0f} |")


def section_memory(cuda, scratch, args, train_args):
    # memory.py's estimate against the peak train.py measures (CUDA's allocator; a CPU's peak RSS), eager as the
    # estimate is: 10 steps are enough for the peak, which the optimizer's first step reaches
    print("### Memory estimate against the measured peak (eager: --compile=False)\n")
    documents(scratch)
    shapes = [("124M", GPT2_124M), ("~1B", NEAR_1B)] if cuda else [("tiny", TINY)]
    layouts = [("one process", []), ("checkpointing", ["--gradient_checkpointing=True"]),
               ("FSDP, CPU offload, checkpointing", ["--fsdp=True", "--fsdp_cpu_offload=True",
                                                     "--gradient_checkpointing=True"])]
    print("| model | layout | estimate MB | measured MB | measured / estimate | tokens/s |\n"
          + "| --- " * 6 + "|")
    for name, shape in shapes:
        for i, (layout, extra) in enumerate(layouts):
            run_args = [*shape, f"--data_dir={scratch}", "--compile=False", *extra]
            g, model, dtype = planned_model([*train_args, *run_args])  # the settings measured
            estimate = memory_estimate(model, g.batch_size, g.block_size, dtype, g.optimizer, fsdp=g.fsdp,
                                       checkpointing=g.gradient_checkpointing, offload=g.fsdp_cpu_offload,
                                       quantized=g.lora_base_dtype if g.lora_base_dtype in ("nf4", "int8") else None,
                                       micro_steps=g.gradient_accumulation_steps, device="cuda" if cuda else "cpu")
            estimate = estimate["device"] / 2**20
            result = attempt(f"{name} | {layout}", throughput, [*train_args, *run_args],
                             f"{scratch}/mem_{name}{i}", min(args.steps, 10), min(args.warmup, 3))
            if result:
                (med, measured) = result
                ratio = f"{measured / estimate:.2f}" if cuda else "n/a (a CPU's is the process's, torch's own too)"
                print(f"| {name} | {layout} | {estimate:,.0f} | {measured:,.0f} | {ratio} | "
                      f"{med['tokens_per_s']:,.0f} |")


def section_optimizers(cuda, scratch, args, train_args):
    # AdamW against Muon for the same steps on text that can be learned: the validation loss each reaches, and
    # its tokens/s (eager: a compile would cost more than the steps; the median of its logs after the first)
    steps = 300 if cuda else args.steps
    every = max(1, steps // 10)
    print(f"### AdamW against Muon at 124M, on this Python's standard library (prepare.py's default corpus, "
          f"bpe:{8192 if cuda else 512})\n")
    data = attempt("prepare.py", stdlib_tokens, scratch, tiny=not cuda)  # a failure is a row, and the rest go on
    if data is None:
        return
    print(f"{steps} steps each\n\n| optimizer | val loss | tokens/s |\n| --- | --- | --- |")
    for name in ("adamw", "muon"):
        run_args = [*train_args, *(GPT2_124M if cuda else TINY), f"--data_dir={data}", "--compile=False",
                    f"--optimizer={name}", f"--warmup_iters={steps // 10}"]
        records = attempt(name, run_train, run_args, f"{scratch}/opt_{name}", steps, evaluate=True,
                          log_interval=every)
        if records:
            loss = [r for r in records if "val_loss" in r][-1]["val_loss"]
            first = min(every, steps - 1)  # the first log's steps hold the start
            warm = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["iter"] > first]
            print(f"| {name} | {loss:.4f} | {statistics.median(warm):,.0f} |")


def full_finetune_room(shape, folder, block_size=1024):
    # why full fine-tuning of this shape cannot run on this GPU and disk, or None: its step's memory (memory.py's
    # estimate, AdamW) against the GPU's, and the disk of its bf16 folder and its checkpoint (fp32 weights and
    # AdamW's two moments, which train.py writes at its end) against what is free
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape))
    need = memory_estimate(model, 1, block_size, "bfloat16", "adamw")["device"]
    gpu = torch.cuda.get_device_properties(0).total_memory
    disk = sum(p.numel() for p in model.parameters()) * (2 + 4 + 8)
    free = shutil.disk_usage(folder).free
    if need > gpu:
        return f"its step needs ~{need / 2**30:,.0f} GiB of GPU memory, and this GPU has {gpu / 2**30:,.0f}"
    if disk > free:
        return (f"its folder and checkpoint need ~{disk / 2**30:,.0f} GiB of disk, and {free / 2**30:,.0f} "
                f"are free")
    return None


def section_finetune(cuda, scratch, args, train_args):
    # full fine-tuning, LoRA and QLoRA of random Qwen3-0.6B- and Llama-2-7B-shaped folders, each row a train.py
    # run of 10 steps; what cannot run here is said in one line before anything is built. At 7B the int8 base
    # is left out: its row would quantize 7B weights on the CPU again to count them, a minute for one row
    print("### Fine-tuning: full, LoRA and QLoRA at micro-batch 1\n")
    skip = []
    if importlib.util.find_spec("torchao") is None:
        print("torchao is not installed (pip install torchao, or without an index the wheels of tools/wheels.py): "
              "the int8 and QLoRA rows are left out\n")
        skip = ["LoRA, int8 base", "QLoRA"]
    if not cuda:
        bench_lora(train_args, TINY_QWEN3, "tiny Qwen3", ["--batch_size=1", "--block_size=32", "--device=cpu"],
                   skip, scratch, peft_device="cpu")
        return
    bench_lora(train_args, QWEN3_06B, "Qwen3-0.6B", ["--batch_size=1", "--block_size=1024"], skip, scratch,
               peft_device="cuda")
    print()
    reason = full_finetune_room(LLAMA2_7B, scratch)
    if reason:
        print(f"full fine-tuning of Llama-2-7B is left out: {reason}\n")
    skip_7b = [*skip, "LoRA, int8 base", *["full"] * bool(reason)]
    bench_lora(train_args, LLAMA2_7B, "Llama-2-7B", ["--batch_size=1", "--block_size=1024"], skip_7b, scratch)


def pytest_summary(label, pytest_args, env):
    # one tier of the tests in a process of its own session (its workers end with it at the deadline): its
    # summary line and its failures' lines
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    try:
        lines = proc.communicate(timeout=max(1.0, measure.deadline - time.time()))[0].strip().splitlines()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        lines = [f"stopped: the {measure.minutes:g} minutes (--minutes) were spent"]
    summary = lines[-1] if lines else "no output"
    if proc.returncode == 5:  # no test collected: a tier this commit does not have
        summary = f"no test here is marked for it ({summary})"
    print(f"| {label} | {summary} | {(time.time() - started) / 60:.1f} |")
    for line in [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]:
        print(f"| | {line[:200]} | |")


def section_tests(cuda, scratch, args, train_args):
    # the CUDA tier (pytest -m cuda), then the quick CPU tier with the GPU hidden, as CI runs it; --tiny: one
    # small file stands for the whole suite
    print("### The tests on this machine\n")
    where = ["tests"] if cuda else ["tests/test_readme.py"]
    print("| tier | summary | minutes |\n| --- | --- | --- |")
    pytest_summary("CUDA tier (pytest -m cuda)", ["-m", "cuda", *where], {})
    if not out_of_time("quick tier"):
        workers = ["-n", "auto"] if cuda and importlib.util.find_spec("xdist") else []
        pytest_summary("quick tier, on the CPU (CUDA_VISIBLE_DEVICES='')", ["-m", "not slow", *workers, *where],
                       {"CUDA_VISIBLE_DEVICES": ""})


RUN = {"versus": section_versus, "race": section_race, "kernels": section_kernels, "step": section_step,
       "memory": section_memory, "optimizers": section_optimizers, "finetune": section_finetune, "tests": section_tests}


def bench_gpu(args, train_args):
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        raise UserError("--mode=gpu measures a CUDA GPU and none is visible here (add --tiny for a smoke check on "
                        "CPU)")
    sections = SECTIONS if args.section == "all" else args.section.split(",")
    if not set(sections) <= set(SECTIONS):
        raise UserError(f"--section={args.section}: choose among {', '.join(SECTIONS)} (comma-separated)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    measure.set_deadline(args.minutes)
    for name in sections:
        started = time.time()
        with written_to(os.path.join(args.out, f"{name}.md") if args.out else None), \
                scratch_folder(name) as scratch:
            gpu_header(cuda, name, args.commit)
            RUN[name](cuda, scratch, args, train_args)
            print(f"\n({name}: {(time.time() - started) / 60:.1f} minutes)\n")
