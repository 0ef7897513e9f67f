"""
bench.py's modes, one function each, (args, train_args) -> prints a Markdown table: train.py's throughput per value of
a setting, a race in equal wall time, seeds beside nanoGPT's run, the fused kernels, the memory estimate of a config's
layouts, a pretrained folder's load, LoRA against full fine-tuning, and prepare.py's encoding; --mode=gpu is gpu.py's.
"""

import argparse
import contextlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

import kernels
from benchmarks.gpu import bench_gpu
from benchmarks.measure import (bench_lora, in_checkout, kernel_cases, kernel_table, planned_model, run_nanogpt,
                                run_ours, run_train, split_loss, throughput)
from configurator import configure
from lib import settings
from lib.files import UserError, read_meta
from lib.hf import save_pretrained
from lib.lora import check_lora
from lib.memory import memory_estimate, memory_layout, memory_table
from lib.optim import check_optimizer
from lib.tokenizer import make_tokenizer
from model import GPT, GPTConfig


# -----------------------------------------------------------------------------
# train.py's throughput (or, racing, the loss it reaches in equal time), once per run


def each_run(args, train_args, measure_run):
    # (train.py's arguments common to every run, [(run's name, measure_run(its arguments, an out_dir))])
    runs = ([shlex.split(r) for r in args.run] if args.run
            else [[f"--{args.compare}={v}"] for v in args.values.split(",")])
    common = list(train_args)
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            rng = np.random.default_rng(0)
            for split in ("train", "val"):
                rng.integers(0, 50257, size=2_000_000, dtype=np.uint16).tofile(os.path.join(tmp, f"{split}.bin"))
            common.append(f"--data_dir={tmp}")  # no meta.json: read as GPT-2 tokens
        rows = []
        for i, extra in enumerate(runs):
            name = " ".join(e.removeprefix("--") for e in extra)
            rows.append((name, measure_run([*common, *extra], os.path.join(tmp, f"out_{i}"))))
    return common, rows


def bench_train(args, train_args):
    common, rows = each_run(args, train_args,
                            lambda run_args, out_dir: throughput(run_args, out_dir, args.steps, args.warmup))
    print(f"\n{' '.join(common)}, {args.steps} steps, medians after {args.warmup}")
    print("| run | tokens/s | ms/iter | MFU | peak memory MB |\n| --- | --- | --- | --- | --- |")
    for name, (med, mem) in rows:
        mfu = f"{med['mfu']:.1%}" if med["mfu"] else "n/a"
        print(f"| {name} | {med['tokens_per_s']:,.0f} | {med['ms_per_iter']:.1f} | {mfu} | {mem:,.0f} |")
    for name, (med, _) in rows[1:]:
        print(f"speedup of {name}: {med['tokens_per_s'] / rows[0][1][0]['tokens_per_s']:.2f}x")


def race(args, run_args, out_dir):
    # as many steps as --seconds hold at the speed just measured, the whole schedule fitted to them
    med, _ = throughput(run_args, out_dir + "_timing", args.steps, args.warmup)
    steps = max(1, round(args.seconds * 1000 / med["ms_per_iter"]))
    records = run_train(run_args, out_dir, steps, evaluate=True)
    last = [r for r in records if "val_loss" in r][-1]
    seconds = [r for r in records if "ms_per_iter" in r][-1]["ms_per_iter"] * steps / 1000  # eval excluded
    return {"ms_per_iter": med["ms_per_iter"], "steps": steps, "seconds": seconds, "val_loss": last["val_loss"],
            "val_accuracy": last["val_accuracy"]}


def bench_race(args, train_args):
    common, rows = each_run(args, train_args, lambda run_args, out_dir: race(args, run_args, out_dir))
    print(f"\n{' '.join(common)}, {args.seconds:g} s of training each (timed on {args.steps} steps)")
    print("| run | ms/iter | steps | training s | val loss | val accuracy |\n" + "| --- " * 6 + "|")
    for name, r in rows:
        print(f"| {name} | {r['ms_per_iter']:.1f} | {r['steps']} | {r['seconds']:.1f} | {r['val_loss']:.4f} "
              f"| {r['val_accuracy']:.1%} |")

# -----------------------------------------------------------------------------
# --mode=seeds: nanoGPT's baby run and our recipe, each final checkpoint scored alike over the whole val split

WINDOW = 64  # the baby's block_size
TINY_SHAPE = ["--max_iters=20", "--lr_decay_iters=20", "--eval_interval=20", "--eval_iters=2", "--warmup_iters=2",
              "--n_layer=1", "--n_head=2", "--n_embd=32"]


def bench_seeds(args, train_args):
    if not args.nanogpt or not os.path.isfile(os.path.join(args.nanogpt, "train.py")):
        raise UserError("--mode=seeds runs nanoGPT's own train.py: name its folder, --nanogpt=DIR")
    nanogpt, tiny = os.path.abspath(args.nanogpt), TINY_SHAPE if args.tiny else []
    config = settings.defaults()
    configure(config, train_args)  # where the data is, for nanoGPT too
    ours = os.path.isfile(os.path.join(config["data_dir"], "meta.json")) and read_meta(config["data_dir"])
    if ours and ours["vocab_size"] != 50257 and not os.path.isfile(os.path.join(config["data_dir"], "meta.pkl")):
        raise UserError(f"{config['data_dir']} has no meta.pkl, without which nanoGPT trains on GPT-2's vocabulary, "
                        f"not its {ours['vocab_size']:,} tokens: prepare it with nanoGPT's own prepare.py")
    tokens = np.fromfile(os.path.join(config["data_dir"], "val.bin"), dtype=np.uint16)  # nanoGPT reads uint16
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    seeds = range(1, (args.seeds or (2 if args.tiny else 5)) + 1)
    rows = {"nanoGPT": [], "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # nanoGPT's seed 1337 + seed_offset moved to seed + seed_offset (measure.SEEDED)
            seconds, model = run_nanogpt(nanogpt, config["data_dir"], f"{tmp}/nanogpt_{seed}", tiny, env, seed)
            rows["nanoGPT"].append((seed, seconds, split_loss(lambda x: model(x, x)[0], tokens, WINDOW)))
        for seed in seeds:
            seconds, model = run_ours([*train_args, *tiny, f"--seed={seed}"], f"{tmp}/ours_{seed}", env)
            rows["ours"].append((seed, seconds, split_loss(lambda x: model(x)[0], tokens, WINDOW)))
    seeds_table(rows, f"{' '.join(train_args)}; {args.threads} threads; {len(tokens):,} val tokens")


def seeds_table(rows, header):
    # rows: {side: [(seed, (wall s, CPU s), loss)]}
    print(f"\n{header}\n| run | seed | wall s | CPU s | val loss, whole split |\n| --- | --- | --- | --- | --- |")
    for side, runs in rows.items():
        for seed, (wall, cpu), loss in runs:
            print(f"| {side} | {seed} | {wall:.1f} | {cpu:.1f} | {loss:.4f} |")
    mean = {side: [statistics.mean(r[1][0] for r in runs), statistics.mean(r[1][1] for r in runs),
                   statistics.mean(r[2] for r in runs)] for side, runs in rows.items()}  # wall, CPU, loss
    for side, runs in rows.items():
        losses = [r[2] for r in runs]
        spread = (f", sd {statistics.stdev(losses):.4f}, {min(losses):.4f} to {max(losses):.4f}"
                  if len(runs) > 1 else "")
        print(f"{side}: {len(runs)} run(s), mean {mean[side][2]:.4f}{spread}; mean wall {mean[side][0]:.1f} s, "
              f"CPU {mean[side][1]:.1f} s")
    worst = max(r[2] for r in rows["ours"])
    verdict = "below it" if worst < mean["nanoGPT"][2] else "not below it"
    print(f"ours, worst seed {worst:.4f} against nanoGPT's mean {mean['nanoGPT'][2]:.4f}: {verdict}; nanoGPT's mean "
          f"wall time / ours: {mean['nanoGPT'][0] / mean['ours'][0]:.2f}x (CPU time: "
          f"{mean['nanoGPT'][1] / mean['ours'][1]:.2f}x)")

# -----------------------------------------------------------------------------
# --mode=kernels: kernels.py's fused ops against their references, eager and compiled, bf16, Llama-like sizes


def bench_kernels(args, train_args):
    if not torch.cuda.is_available():
        raise UserError("--mode=kernels measures Triton kernels on a CUDA GPU, and none is visible here")
    if not kernels.HAS_TRITON:
        raise UserError("--mode=kernels needs Triton: pip install triton")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {kernels.triton.__version__}, bf16")
    kernel_table(kernel_cases("cuda"), "cuda")

# -----------------------------------------------------------------------------
# --mode=memory: memory_estimate for a config in the layouts a run on 1, 8 or 64 GPUs could take; the model is
# built on the meta device (no GPU needed), assumed on GPUs: bf16 where dtype is auto, the kernels on.


def runs_under(g, **layout):
    # whether train.py takes settings g (a namespace) in this layout: its optimizer's and LoRA's own checks
    try:
        check_optimizer({**vars(g), **layout})
        check_lora(g.lora_rank, g.lora_rank, g.lora_base_dtype, layout["tp_size"], layout["fsdp"])
    except UserError:
        return False
    return True


def memory_layouts(g, shape):
    # (GPUs, memory_estimate's layout) for one GPU, 8 and 64, those train.py runs g in (Muon and a quantized LoRA
    # base refuse FSDP)
    layouts = [(1, dict()), (1, dict(checkpointing=True)),
               (1, dict(fsdp=True, checkpointing=True, offload=True))]
    for gpus in (8, 64):
        layouts += [(gpus, dict(dp=gpus)), (gpus, dict(dp=gpus, fsdp=True)),
                    (gpus, dict(dp=gpus, fsdp=True, checkpointing=True))]
        # tensor parallel within a node of 8, over as many as the heads divide among, where train.py runs it
        tp = max(t for t in (8, 4, 2, 1) if shape.n_head % t == 0 and shape.n_kv_head % t == 0)
        if tp > 1:
            layouts.append((gpus, dict(dp=gpus // tp, tp=tp, fsdp=True, checkpointing=True)))  # TP brings FSDP
        layouts.append((gpus, dict(dp=gpus, fsdp=True, checkpointing=True, offload=True)))
    return [(gpus, layout) for gpus, layout in layouts  # (an update's micro-steps shared out over the replicas)
            if runs_under(g, tp_size=layout.get("tp", 1), fsdp=layout.get("fsdp", False))
            and g.gradient_accumulation_steps % layout.get("dp", 1) == 0]


def bench_memory(args, train_args):
    g, model, dtype = planned_model(train_args)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{model.num_params() / 1e6:,.1f}M parameters ({trained / 1e6:,.1f}M trained), {dtype}, "
          f"{g.optimizer}, micro-batch {g.batch_size} x {g.block_size} tokens per GPU")
    rows = [(f"{gpus} GPU{'s' * (gpus > 1)}: {memory_layout(**layout)}",
             memory_estimate(model, g.batch_size, g.block_size, dtype, g.optimizer,
                             quantized=g.lora_base_dtype if g.lora_base_dtype in ("nf4", "int8") else None,
                             micro_steps=g.gradient_accumulation_steps // layout.get("dp", 1), **layout))
            for gpus, layout in memory_layouts(g, model.config)]
    print(memory_table(rows))

# -----------------------------------------------------------------------------
# --mode=load: peak memory of load_pretrained against a whole-file read, each in a fresh process. safetensors' mmap'd
# pages count in RSS but are the kernel's cache: the process's own (anonymous) memory is what a load costs. Every
# script imports torch._dynamo first, as every train.py run does (torch's optimizers do), and as a model's init on the
# meta device does (~75 MB): a load's figure is then the load's alone.

LOADERS = {
    "baseline (import torch, torch._dynamo and model.py)": "pass",
    "load_pretrained (streamed)": "m = load_pretrained(folder)",
    "file read whole, then a model": "from safetensors.torch import load\n"
                                     "w = load(open(folder + '/model.safetensors', 'rb').read()); "
                                     "m = GPT(GPTConfig(**shape))",
}


def peak_memory(script):
    # (peak anonymous MB, peak RSS MB) of a python -c script, polled while it runs
    proc = subprocess.Popen([sys.executable, "-c", script])
    anon = rss = 0
    while proc.poll() is None:
        with contextlib.suppress(OSError, KeyError), open(f"/proc/{proc.pid}/status") as f:
            status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("RssAnon", "VmRSS"))}
            anon, rss = max(anon, int(status["RssAnon"])), max(rss, int(status["VmRSS"]))
        time.sleep(0.002)
    assert proc.returncode == 0, script
    return anon / 1024, rss / 1024


def bench_load(args, train_args):
    with tempfile.TemporaryDirectory() as folder:
        shape = dict(vocab_size=32000, block_size=2048, n_layer=16, n_head=16, n_embd=1024, mlp_hidden=2816)
        if args.tiny:  # a smoke test of the mode's own code, a folder of ~2 MB
            shape = dict(shape, vocab_size=512, n_layer=2, n_embd=128, n_head=4, mlp_hidden=256)
        save_pretrained(GPT(GPTConfig(**shape)), folder)
        size = os.path.getsize(os.path.join(folder, "model.safetensors")) / 2**20
        print(f"folder: {size:,.0f} MB of fp32 weights, torch {torch.__version__}")
        print("| load | peak anonymous MB | above baseline | peak RSS MB (with mmap'd file pages) |\n"
              "| --- | --- | --- | --- |")
        baseline = None
        for name, code in LOADERS.items():
            script = (f"import torch._dynamo\nfrom model import GPT, GPTConfig\nfrom lib.hf import load_pretrained\n"
                      f"folder, shape = {folder!r}, {shape!r}\n{code}\nimport time; time.sleep(0.1)")
            anon, rss = peak_memory(script)
            baseline = baseline or anon
            print(f"| {name} | {anon:,.0f} | {anon - baseline:,.0f} | {rss:,.0f} |")

# -----------------------------------------------------------------------------
# --mode=encode: prepare.py's reading, cutting and encoding against tiktoken's encode_ordinary_batch alone


def prepare_run(argv):
    # the seconds prepare.py reports for reading, cutting and encoding (start-up and writing left out, as for tiktoken)
    done = subprocess.run([sys.executable, in_checkout("prepare.py"), *argv], capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"prepare.py failed: {done.stderr.strip()[-500:]}")
    return float(re.search(r"tokenized .* in ([\d.]+) s with", done.stdout)[1])


def encoded_texts(folder, tokenizer):
    # the documents a prepared dataset holds, decoded: each is followed by an end-of-text
    meta = read_meta(folder)
    texts = []
    for split in ("train", "val"):
        ids = np.fromfile(os.path.join(folder, f"{split}.bin"), dtype=meta["dtype"])
        ends = np.flatnonzero(ids == meta["eot_id"])
        starts = [0, *(ends + 1)]
        texts += [tokenizer.enc.decode(ids[a:b].tolist()) for a, b in zip(starts, [*ends, ids.size]) if b > a]
    return texts


def bench_encode(args, train_args):
    options = argparse.ArgumentParser(add_help=False)
    options.add_argument("--tokenizer", default="gpt2")
    options.add_argument("--num_workers", type=int, default=0)
    given = options.parse_known_args(train_args)[0]
    tokenizer = make_tokenizer(given.tokenizer, lambda: iter(()))
    if tokenizer.kind != "tiktoken":
        raise UserError("--mode=encode compares against tiktoken: pass a tiktoken encoding, e.g. --tokenizer=gpt2")
    threads = max(1, given.num_workers or len(os.sched_getaffinity(0)))
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*train_args, f"--out_dir={tmp}", "--overwrite"]
        prepare_run(argv)  # a first run, not timed: the texts it encodes, and the files read into the cache
        texts = encoded_texts(tmp, tokenizer)

        def tiktoken_run():
            started = time.time()
            tokenizer.enc.encode_ordinary_batch(texts, num_threads=threads)
            return time.time() - started

        runs = {"tiktoken": tiktoken_run, "prepare": lambda: prepare_run(argv)}
        seconds = {name: [] for name in runs}
        for _ in range(5):  # side by side, alternating, the best of each: CPU timings are noisy
            for name, run in runs.items():
                seconds[name].append(run())
    tiktoken_s, prepare_s = (min(seconds[name]) for name in runs)
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    print(f"bench: {mb:.1f} MB in {len(texts)} documents, {tokenizer.name}, {threads} threads, best of 5")
    print(f"  tiktoken encode_ordinary_batch (text in memory):  {mb / tiktoken_s:6.1f} MB/s")
    print(f"  prepare.py (read, cut and encode, as it reports): {mb / prepare_s:6.1f} MB/s")
    print(f"  ratio: {tiktoken_s / prepare_s:.2f} of tiktoken's throughput")

# -----------------------------------------------------------------------------

MODES = {"train": bench_train, "race": bench_race, "kernels": bench_kernels, "load": bench_load,
         "lora": lambda args, train_args: bench_lora(train_args), "memory": bench_memory, "encode": bench_encode,
         "gpu": bench_gpu, "seeds": bench_seeds}
