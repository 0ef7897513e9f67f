"""
How bench.py measures, shared by its modes and by the GPU report (gpu.py): train.py run as a user runs it
and the medians of its logged steps; one call's time and peak memory; each fused kernel against its references;
the model a planned run would build, on the meta device (memory.py's estimate reads it); full, LoRA and QLoRA
fine-tuning side by side; and nanoGPT's own train.py run from a folder the user gives, with the loss of any model
over a whole split (bench.py --mode=seeds). A train.py that fails raises UserError with the end of its output.
"""

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

import kernels
from configurator import configure
from lib.checkpoint import find_checkpoint
from lib.resume import load_checkpoint, model_from_checkpoint
from lib.files import UserError, read_json, read_meta
from lib.hf import config_from_hf, save_pretrained
from lib.lora import add_lora, quantize_base
from lib.memory import tensor_bytes
from lib.parallel import pick_device
from lib.settings import check, check_sizes, defaults, model_settings
from lib.start import frozen_dtype
from lib.trained import load_model
from model import GPT, GPTConfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, where train.py is


def in_checkout(script):
    # a script of this checkout, from whatever folder bench.py runs in (where the paths given are)
    return os.path.join(HERE, script)


# --mode=gpu: the time after which no more rows begin, and the --minutes it was set from (set_deadline)
deadline, minutes = float("inf"), None


def set_deadline(limit_minutes):
    global deadline, minutes
    deadline, minutes = time.time() + 60 * limit_minutes, limit_minutes


def out_of_time(label):
    # A row is not begun once --minutes are spent (one line says so), so that a run under a time limit (a
    # batch job's, a rented machine's) ends inside it with every row it began.
    if time.time() < deadline:
        return False
    print(f"| {label} | skipped: the {minutes:g} minutes (--minutes) are spent |")
    return True

# -----------------------------------------------------------------------------
# train.py, run as a user runs it: its log records, and the medians of its steps


def run_train(run_args, out_dir, steps, evaluate=False, log_interval=None, env=None):
    # train.py's own log records; without evaluate, only one evaluation at the start, on a single batch. env:
    # variables added to this process's for the run.
    evals = [f"--eval_interval={steps + 1}", "--eval_iters=1", "--log_interval=1"]
    if evaluate:
        evals = [f"--eval_interval={steps}", f"--lr_decay_iters={steps}",
                 f"--log_interval={log_interval or steps}"]
    cmd = [sys.executable, in_checkout("train.py"), *run_args, f"--out_dir={out_dir}", f"--max_iters={steps}", *evals,
           "--always_save_checkpoint=False"]
    timed_run(cmd, None, {**os.environ, **env} if env else None, "train.py")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(out_dir, ignore_errors=True)  # its checkpoint: a measurement keeps nothing of a run but its log
    return records


def throughput(run_args, out_dir, steps, warmup, env=None):
    # (the medians of tokens/s, ms/iter and both MFUs over the steps after warmup, the peak memory in MB)
    records = run_train(run_args, out_dir, steps, env=env)
    records = [r for r in records if "tokens_per_s" in r and r["iter"] > warmup]
    keys = ("tokens_per_s", "ms_per_iter", "mfu", "mfu_run")
    med = {k: statistics.median(r.get(k) or 0 for r in records) for k in keys}
    return med, max(r["mem_mb"] for r in records)

# -----------------------------------------------------------------------------
# the fused ops of kernels.py against their references, eager and compiled


def kernel_cases(device, tokens=(8192, 32768), widths=(2048, 4096), vocabs=(50304, 128256), D=128):
    # (op, size, inputs(), call(op, *inputs)) in bf16 at Llama-like sizes: tokens x width, D the head size

    def rand(*shape, std=1.0, grad=True):
        return (std * torch.randn(*shape, device=device, dtype=torch.bfloat16)).requires_grad_(grad)

    def rotary_inputs(N, C):  # q as a strided view into a wider tensor (the model's is contiguous)
        T = min(N, 2048)
        angles = torch.outer(torch.arange(T, device=device).float(), torch.rand(D // 2, device=device))
        return [rand(N // T, T, 3 * C), angles.cos(), angles.sin()]

    def rotary_call(f, qkv, cos, sin):
        B, T, C3 = qkv.shape
        return f(qkv[..., :C3 // 3].view(B, T, C3 // 3 // D, D), cos, sin)

    cases = []
    for N in tokens:
        for C in widths:
            H = 64 * math.ceil(8 * C / 3 / 64)  # the model's SwiGLU width
            cases += [
                ("rms_norm", f"{N}x{C}", lambda N=N, C=C: [rand(N, C), rand(C)], lambda f, x, w: f(x, w, 1e-5)),
                ("swiglu", f"{N}x{H}", lambda N=N, H=H: [rand(N, 2 * H)], lambda f, gu: f(*gu.chunk(2, -1))),
                ("apply_rotary", f"{N}x{C}", lambda N=N, C=C: rotary_inputs(N, C), rotary_call),
            ]
    for V in vocabs:
        for N in tokens:
            for C in widths:
                inputs = lambda N=N, C=C, V=V: [rand(N, C), rand(V, C, std=0.02),
                                                torch.randint(0, V, (N,), device=device)]
                cases.append(("linear_cross_entropy", f"{N}x{C} V={V}", inputs, lambda f, *a: f(*a)))
    return cases


def time_call(fn, leaves, device):
    # (median ms, peak MB above what was allocated before, or None on a CPU), or None when out of memory
    cuda = device.startswith("cuda")
    try:
        fn()  # warm up: compile, autotune, cache
        for t in leaves:
            t.grad = None
        if not cuda:  # a CPU's timing, for the smoke check: the median of a few calls, no memory
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1000)
            return statistics.median(times), None
        from triton.testing import do_bench  # Triton is optional, and there is no CUDA timing without it
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return do_bench(fn, warmup=50, rep=500, grad_to_none=leaves, return_mode="median"), peak
    except torch.OutOfMemoryError:
        return None
    finally:
        for t in leaves:
            t.grad = None
        if cuda:
            torch.cuda.empty_cache()


def kernel_rows(name, size, call, impls, inputs, device):
    # one case's two rows, forward and forward+backward: each of impls (None: not run) timed on inputs
    leaves = [t for t in inputs if t.requires_grad]
    with torch.no_grad():  # the output's shape, from the op that needs the least memory
        dy = torch.randn_like(call(impls[2], *inputs))
    for pass_ in ("fwd", "fwd+bwd"):
        if pass_ == "fwd":
            results = [time_call(lambda f=f: call(f, *inputs), leaves, device) if f else None for f in impls]
        else:
            results = [time_call(lambda f=f: call(f, *inputs).backward(dy), leaves, device) if f else None
                       for f in impls]
        ms = [f"{r[0]:.3f}" if r else "OOM" if f else "-" for r, f in zip(results, impls)]
        mb = [f"{r[1]:,.0f}" if r and r[1] is not None else "OOM" if f and not r else "-"
              for r, f in zip(results, impls)]
        ratio = [f"{r[0] / results[2][0]:.2f}" if r and results[2] else "-" for r in results[:2]]
        print(f"| {name} | {size} | {pass_} | {' | '.join(ms)} | {' | '.join(ratio)} | {' | '.join(mb)} |")


def kernel_table(cases, device, compiled=True):
    # each case eager, compiled (unless not compiled) and fused, forward and forward+backward: a Markdown table
    torch._dynamo.config.recompile_limit = 64  # the compiled references recompile for every size
    print("linear_cross_entropy computes its gradients in forward: compare it on fwd+bwd\n")
    print("| op | size | pass | eager ms | compiled ms | triton ms | speedup vs eager | vs compiled "
          "| eager MB | compiled MB | triton MB |\n" + "| --- " * 11 + "|")
    for name, size, make_inputs, call in cases:
        if out_of_time(f"{name} | {size}"):
            continue
        ref = getattr(kernels, name + "_ref")
        impls = [ref, torch.compile(ref, dynamic=False) if compiled else None, getattr(kernels, name)]
        kernel_rows(name, size, call, impls, make_inputs(), device)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def matmul_peak(cuda):
    # The FLOP/s one large matmul reaches here (bf16 on a GPU, fp32 on a CPU): the ceiling a training step can
    # really approach, beside the datasheet's (an H100 SXM's bf16 matmul reaches ~80% of its 989 TFLOP/s).
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    ms, _ = time_call(lambda: a @ b, [], device)
    return 2 * n ** 3 / (ms / 1000)

# -----------------------------------------------------------------------------
# a planned train.py run: its settings and its model on the meta device, nothing allocated


def planned_shape(g):
    # the GPTConfig of a run's settings: a Hugging Face folder's, a resume's checkpoint's, or the settings' own
    found = g.init_from in ("resume", "auto") and find_checkpoint(os.path.join(g.out_dir, "ckpt.pt"))
    if found:  # as train.py resumes it: the checkpoint's shape (LoRA's adapters: planned_model's), this run's length
        args = {**load_checkpoint(found, weights=False)["model_args"], "block_size": g.block_size, "lora_rank": 0}
        check_sizes(args, "the checkpoint's model_args", "use another checkpoint")
        return GPTConfig(**args)
    if g.init_from not in ("scratch", "resume", "auto"):  # a Hugging Face folder: its shape
        try:
            return config_from_hf(read_json(os.path.join(g.init_from, "config.json")), g.block_size)
        except (ValueError, KeyError) as e:
            raise UserError(str(e)) from e
    vocab = g.vocab_size
    if not vocab:  # the dataset's, padded as train.py pads it; GPT-2's without one
        have_data = os.path.exists(os.path.join(g.data_dir, "meta.json"))
        vocab = 64 * -(-read_meta(g.data_dir)["vocab_size"] // 64) if have_data else 50304
    args = {**{k: getattr(g, k) for k in model_settings()}, "vocab_size": vocab}
    check_sizes(args, "this run", "set it within its range (model.py's GPTConfig)")
    try:  # GPTConfig's fields, as train.py's run from scratch takes them from its settings (start.begin)
        return GPTConfig(**args)
    except ValueError as e:  # sizes no model can have
        raise UserError(str(e)) from None


def planned_model(overrides):
    # (settings, model on the meta device, dtype) of a train.py run with these overrides: GPU settings (bf16
    # where dtype is auto, the kernels on) unless it runs on a CPU
    config = defaults()
    configure(config, overrides)
    check(config)  # the values no run can use, refused as train.py refuses them
    pick_device("cpu", config["dtype"])  # (its dtype's check alone: the device planned may be a GPU this one lacks)
    g = argparse.Namespace(**config)
    on_cpu = g.device == "cpu"
    dtype = ("float32" if on_cpu else "bfloat16") if g.dtype == "auto" else g.dtype
    shape = planned_shape(g)
    shape.use_kernels = not on_cpu if g.use_kernels is None else g.use_kernels  # a GPU's default, with Triton
    with torch.device("meta"):
        model = GPT(shape)
        if g.lora_rank:  # the frozen base in the dtype it computes in (nf4: counted at its size)
            base = dtype if g.lora_base_dtype in ("auto", "nf4", "int8") else g.lora_base_dtype
            add_lora(model.to(getattr(torch, base)), g.lora_rank, g.lora_alpha, g.lora_dropout, g.lora_targets)
    return g, model, dtype

# -----------------------------------------------------------------------------
# a few steps of full fine-tuning, LoRA and QLoRA of the same random folder, side by side, each a real train.py
# run: its optimizer state (from its checkpoint), the frozen base's weights, the peak memory it logged and its
# tokens/s

FINETUNES = {"full": [], "LoRA": ["--lora_rank=16"], "LoRA, int8 base": ["--lora_rank=16", "--lora_base_dtype=int8"],
             "QLoRA": ["--lora_rank=16", "--lora_base_dtype=nf4"]}
QWEN3_06B = dict(vocab_size=151936, block_size=4096, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024,
                 head_size=128, mlp_hidden=3072, qk_norm=True, family="qwen3")


def random_folder(shape, folder):
    # a Hugging Face folder of random bf16 weights (as the Hub holds them), built on the meta device and filled
    # in place: no fp32 copy of a 7B model on the way
    with torch.device("meta"):
        model = GPT(GPTConfig(**shape)).to(torch.bfloat16)
    model = model.to_empty(device="cpu").materialize()
    with torch.no_grad():
        for p in model.parameters():  # norms' weights 1, the rest small: the scale of a trained model
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    save_pretrained(model, folder)


def random_tokens(folder, vocab):
    # train.bin and val.bin of random ids below vocab, which is the end-of-text id, and their meta.json (whose
    # vocabulary holds that id too)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, vocab, size=200_000, dtype=np.uint32).tofile(f"{folder}/{split}.bin")
    with open(f"{folder}/meta.json", "w") as f:
        json.dump({"dtype": "uint32", "vocab_size": vocab + 1, "eot_id": vocab}, f)


PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # our seven


def peft_finetune(folder, data_dir, lora, steps, block_size, device):
    """transformers (with peft's LoRA r16 on the seven projections, where lora) fine-tuning the Hugging Face folder
    on data_dir's train.bin, as a user of those libraries writes it: the weights in bf16 on a GPU (fp32 on a CPU),
    SDPA, fused AdamW, clipping at 1, micro-batch 1 x block_size, eager -> (median tokens/s of the steps after the
    first two, peak MB on CUDA or None). transformers and peft are the tests' and this row's, not the project's."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    logging.disable_progress_bar()  # its loading bar is not a line of the report
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").to(device)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=16, target_modules=PEFT_TARGETS))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device == "cuda")
    tokens, rng, times = np.fromfile(os.path.join(data_dir, "train.bin"), dtype=np.uint32), np.random.default_rng(0), []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        start = int(rng.integers(0, len(tokens) - block_size))
        x = torch.from_numpy(tokens[start:start + block_size].astype(np.int64))[None].to(device)
        began = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss  # the labels shifted inside: block_size - 1 targets, as ours
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the step's end
        times.append(time.perf_counter() - began)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return block_size / statistics.median(times[2:]), peak


def bench_lora(train_args, shape=QWEN3_06B, name="Qwen3-0.6B", extra_args=(), skip=(), scratch=None, steps=10,
               peft_device=None):
    # each of FINETUNES but those in skip, for steps steps (more than 3: the tokens/s of the steps after the
    # first two), in a temporary folder under scratch; with peft_device, transformers + peft fine-tune the same
    # folder on the same data beside them (full and LoRA), and a table puts ours against theirs
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        random_folder(shape, f"{tmp}/model")
        random_tokens(tmp, shape["vocab_size"] - 1)  # the last id is end-of-text
        settings, ours = " ".join([*train_args, *extra_args]) or "train.py defaults", {}
        print(f"{name} shape, torch {torch.__version__}, {settings}, {steps} steps\n")
        print("| fine-tune | trained parameters | optimizer state MB | frozen base MB | peak memory MB "
              "| tokens/s |\n" + "| --- " * 6 + "|")
        for label, extra in FINETUNES.items():
            if label in skip or out_of_time(label):
                continue
            out = f"{tmp}/out_{label}"
            cmd = [sys.executable, in_checkout("train.py"), *train_args, *extra_args,  # (its own last: they win, as
                   f"--init_from={tmp}/model", f"--data_dir={tmp}", f"--out_dir={out}",  # run_train's do)
                   f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=1", "--log_interval=1", *extra]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:  # out of memory, or torchao missing: one line, and the next goes on
                print(f"| {label} | failed: {done.stdout.strip().splitlines()[-1][:200]} |")
            else:
                row, ours[label] = finetune_row(label, out, extra)
                print(row)
            shutil.rmtree(out, ignore_errors=True)  # its checkpoint, read: a 7B one fills a disk
        if peft_device:
            block_size = int(next(a for a in extra_args if a.startswith("--block_size=")).split("=")[1])
            beside_peft(ours, f"{tmp}/model", tmp, steps, block_size, peft_device)


def beside_peft(ours, folder, data_dir, steps, block_size, device):
    # ours {label: (tokens/s, peak MB)} against transformers + peft on the same folder, data and steps
    print(f"\nAgainst transformers + peft on the same folder, tokens and steps ({device}: bf16 weights on a GPU, "
          f"SDPA, fused AdamW, clipping at 1, eager)\n")
    print("| fine-tune | ours tokens/s | theirs tokens/s | ours / theirs | ours peak MB | theirs peak MB |\n"
          + "| --- " * 6 + "|")
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("peft") is None:
        return print("| transformers + peft | not installed here: no rows |")
    for label in ("full", "LoRA"):
        if label not in ours or out_of_time(f"transformers + peft, {label}"):
            continue
        speed, peak = peft_finetune(folder, data_dir, label == "LoRA", steps, block_size, device)
        mine = ours[label]
        print(f"| {label} | {mine[0]:,.0f} | {speed:,.0f} | {mine[0] / speed:.2f}x | {mine[1]:,.0f} | "
              f"{'n/a' if peak is None else f'{peak:,.0f}'} |")
        if device == "cuda":
            torch.cuda.empty_cache()


def finetune_row(label, out, extra):
    # a fine-tuning run's row: what its checkpoint holds (optimizer state, the frozen base as it ran) and what it
    # logged (the peak memory, the median tokens/s after the first two steps, which hold the warm-up)
    ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True, mmap=True)
    state = sum(tensor_bytes(t) for s in ckpt["optimizer"]["state"].values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    ckpt["optimizer"] = None
    # a LoRA run's frozen base in the dtype it ran in: bf16 on a GPU, fp32 on a CPU (where dtype='auto' is fp32)
    config = ckpt["config"]
    model = model_from_checkpoint(ckpt, frozen_dtype(config["lora_base_dtype"], config["dtype"]))
    quantized = [e.split("=")[1] for e in extra if e.startswith("--lora_base_dtype=")]
    if quantized:
        quantize_base(model, quantized[0])
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(tensor_bytes(p) for p in model.parameters() if not p.requires_grad)
    with open(f"{out}/metrics.jsonl") as f:
        records = [json.loads(line) for line in f if "tokens_per_s" in line]
    peak = max(r["mem_mb"] for r in records)
    speed = statistics.median(r["tokens_per_s"] for r in records if r["iter"] > 2)
    return (f"| {label} | {trained / 1e6:,.1f}M | {state / 2**20:,.0f} | {frozen / 2**20:,.0f} | {peak:,.0f} "
            f"| {speed:,.0f} |"), (speed, peak)

# -----------------------------------------------------------------------------
# nanoGPT beside us: its own train.py, unchanged, run from the folder a user gives (nothing of it is copied here),
# each run's final checkpoint, and the loss of either model over a whole split, computed the same way for both

# nanoGPT's CPU "baby" run of Shakespeare's characters (its README's command, on top of its
# config/train_shakespeare_char.py), with a checkpoint at every evaluation so that the last one is the model after
# its 2,000 iterations (its config keeps the best 20-batch estimate instead)
NANOGPT_BABY = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=100", "--block_size=64",
                "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
                "--lr_decay_iters=2000", "--dropout=0.0", "--always_save_checkpoint=True"]


def timed_run(cmd, cwd, env, who):
    # a training script run to its end -> (wall seconds, CPU seconds of the process), start-up and evaluations
    # included. On a machine that others share, the CPU seconds are the steadier of the two.
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        raise UserError(f"{who} failed:\n{done.stdout[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter() - start, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime


# nanoGPT's train.py fixes its seed in code (torch.manual_seed(1337 + seed_offset), no setting): run unchanged
# from this wrapper, which moves that seed by the one asked for before running it, as `python train.py` would,
# and prints the CUDA allocator's peak once it ends (its log has none)
SEEDED = """
import atexit, runpy, sys, torch
seed, folder, sys.argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
sys.path.insert(0, folder)  # its model.py, as running train.py from its folder would find it
manual_seed = torch.manual_seed
torch.manual_seed = lambda s: manual_seed(s - 1337 + seed)  # seed 1337: nanoGPT's own run, exactly
if torch.cuda.is_available():
    atexit.register(lambda: print(f"peak memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MB"))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def nanogpt_command(nanogpt, data_dir, folder, run_args, seed=1337):
    # the command that runs nanoGPT's train.py (SEEDED) with run_args on data_dir's train.bin/val.bin, from folder:
    # it reads configurator.py and data/<dataset>/ from its working folder, and a folder of links to both stands in
    os.makedirs(os.path.join(folder, "data"))
    os.symlink(os.path.join(nanogpt, "configurator.py"), os.path.join(folder, "configurator.py"))
    os.symlink(os.path.abspath(data_dir), os.path.join(folder, "data", "given"))
    return [sys.executable, "-c", SEEDED, str(seed), nanogpt, os.path.join(nanogpt, "train.py"), *run_args,
            "--dataset=given", "--out_dir=out"]


def run_nanogpt(nanogpt, data_dir, folder, extra, env, seed=1337):
    # nanoGPT's baby run with its seed moved to `seed` -> ((wall, CPU seconds), its model from the final checkpoint)
    run_args = [os.path.join(nanogpt, "config", "train_shakespeare_char.py"), *NANOGPT_BABY, *extra]
    seconds = timed_run(nanogpt_command(nanogpt, data_dir, folder, run_args, seed), folder, env, "nanoGPT's train.py")
    return seconds, nanogpt_model(nanogpt, os.path.join(folder, "out", "ckpt.pt"))


def nanogpt_module(nanogpt):
    # nanoGPT's model.py, imported from its folder under a name of its own (ours is `model`)
    spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(nanogpt, "model.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def nanogpt_model(nanogpt, path):
    # nanoGPT's model with a checkpoint's weights (plain tensors; `_orig_mod.` before their names when compiled)
    module = nanogpt_module(nanogpt)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    with contextlib.redirect_stdout(io.StringIO()):  # its count of parameters is no line of our reports
        model = module.GPT(module.GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()})
    return model.eval()


def profiled_step(model, optimizer, batches, steps, compile):
    """model's training step, as both nanoGPT's train.py and ours make it: (_, loss) = model(x, y) under bf16
    autocast on CUDA, backward, clipping at 1, the optimizer's step; steps of it on batches [(x, y), ...] in turn,
    nothing else on the host -> (median ms a step past the first third (CUDA events on a GPU), the peak MB (CUDA),
    torch.profiler's table of three more steps: the 15 ops that took the most device time, or CPU time on a CPU)."""
    cuda = batches[0][0].is_cuda
    compiled = torch.compile(model) if compile else model  # the module, as both train.py's compile it
    autocast = torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=cuda)

    def step(i):
        x, y = batches[i % len(batches)]
        with autocast:
            loss = compiled(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for i in range(-3, steps):  # three to compile and warm up, not timed
        began = time.perf_counter()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        if cuda:
            events[0].record()
        step(i)
        if cuda:
            events[1].record()
        if i >= 0:
            times.append(events if cuda else (time.perf_counter() - began) * 1000)
    if cuda:
        torch.cuda.synchronize()
    ms = [start.elapsed_time(end) for start, end in times] if cuda else times
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * cuda
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(3):
            step(i)
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=15,
                                      max_name_column_width=70)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    return statistics.median(ms[len(ms) // 3:]), peak, table


def run_ours(run_args, out_dir, env):
    # our train.py with these arguments -> ((wall, CPU seconds), the model of its final checkpoint)
    cmd = [sys.executable, in_checkout("train.py"), *run_args, f"--out_dir={out_dir}"]
    seconds = timed_run(cmd, None, env, "train.py")
    model, _ = load_model(os.path.join(out_dir, "ckpt.pt"))
    return seconds, model.eval()


def split_loss(logits_of, tokens, window, batch=64, device="cpu"):
    # the mean cross-entropy over every token of a split cut into non-overlapping windows of `window` targets (each
    # window's inputs the tokens before them, nothing carried between windows); logits_of(x (B, T)) -> (B, T, V),
    # on device (where the model is)
    n = (len(tokens) - 1) // window
    x = torch.from_numpy(tokens[:n * window].astype(np.int64)).view(n, window).to(device)
    y = torch.from_numpy(tokens[1:n * window + 1].astype(np.int64)).view(n, window).to(device)
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, batch):
            logits = logits_of(x[i:i + batch])  # (B, T, V)
            targets = y[i:i + batch].flatten()
            total += F.cross_entropy(logits.float().flatten(0, 1), targets, reduction="sum").item()
    return total / (n * window)
