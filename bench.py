"""
Measurements. Training throughput of a config runs the real train.py, once per value of a setting
(eager against torch.compile by default), and reports the median tokens/s, ms/iter and MFU of the
steps after warmup, and peak memory:

    python bench.py config/train_small.py
    python bench.py config/train_gpt2.py --synthetic --compare=use_kernels --steps=30
    python bench.py config/train_small.py --compare=optimizer --values=adamw,muon,adam,sgd

--mode=race gives every run the same wall time instead: it times --steps of each, then trains each for
as many steps as fit in --seconds (its schedule ending there) and reports the validation loss reached.
--run names a whole set of overrides, once per run, instead of --compare's values (each optimizer wants its
own learning rate):

    python bench.py config/train_shakespeare_char_cpu.py --mode=race --seconds=20 --compare=lr_schedule \
        --values=cosine,wsd
    python bench.py config/train_small.py --mode=race --seconds=120 \
        --run="--optimizer=adamw" --run="--optimizer=muon" --run="--optimizer=sgd --learning_rate=0.3"
    python bench.py --mode=kernels   # each fused op of kernels.py against its references (GPU)
    python bench.py --mode=load      # peak memory of load_pretrained on a generated ~1 GB folder
    python bench.py --mode=lora      # memory of full fine-tuning, LoRA and QLoRA of a Qwen3-0.6B shape
    python bench.py --mode=memory config/train_gpt2.py   # memory per GPU on 1, 8 and 64 of them, estimated
    python bench.py --mode=sft --steps=300   # fine-tuning on answers only against every token; packing
    python bench.py --mode=gpu --out=gpu      # all a GPU must show, for BENCHMARKS.md (--tiny: on CPU)
    python bench.py --mode=gpu --section=step --out=gpu   # one part alone: gpu/step.md, line by line

--synthetic trains on random tokens (no prepared data needed); any other --key=value goes to train.py.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compare", default="compile", help="a setting of train.py to run with each of --values")
parser.add_argument("--values", default="False,True", help="comma-separated values of --compare")
parser.add_argument("--run", action="append", help="instead of --compare: --run='--key=value ...', once per run")
parser.add_argument("--seconds", type=float, default=60, help="--mode=race: training seconds per run")
parser.add_argument("--steps", type=int, default=50, help="training steps per run")
parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
parser.add_argument("--synthetic", action="store_true", help="random tokens (vocab 50257) instead of data_dir")
parser.add_argument("--mode", choices=["train", "race", "kernels", "load", "lora", "memory", "sft", "gpu"],
                    default="train",
                    help="race: equal wall time per run; kernels: time kernels.py's ops; load: memory of "
                         "loading a Hugging Face folder; lora: memory of full, LoRA and QLoRA fine-tuning; "
                         "memory: a config's memory per GPU on 1, 8 and 64 GPUs, estimated without a GPU; "
                         "sft: a task's exact match trained on answers only and on every token, and packing; "
                         "gpu: all a GPU must show, as Markdown for BENCHMARKS.md")
parser.add_argument("--tiny", action="store_true", help="--mode=gpu at tiny shapes on a CPU: a smoke check")
parser.add_argument("--section", default="all",
                    help="--mode=gpu: the parts of the report to run, comma-separated: kernels, step, memory, "
                         "optimizers, finetune, tests (README.md, 'Measuring on a GPU')")
parser.add_argument("--out", help="--mode=gpu: a folder for each section's Markdown (SECTION.md), "
                                  "written as it goes")
parser.add_argument("--commit", help="--mode=gpu: the commit the report names (default: git describe, else the "
                                     "wheels/COMMIT that wheels.py writes)")
parser.add_argument("--minutes", type=float, default=6.5,
                    help="--mode=gpu: no row begins after this many minutes (a GPU machine's call may last 10)")
args, train_args = parser.parse_known_args()
if args.warmup >= args.steps:
    sys.exit(f"bench.py: --warmup={args.warmup} leaves no steps to measure of --steps={args.steps}")
deadline = float("inf")  # --mode=gpu: the time after which no more rows begin


def out_of_time(label):
    # a row not begun once --minutes are spent (one line says so), so that a call on the GPU machine ends
    # inside its limit with every row it began
    if time.time() < deadline:
        return False
    print(f"| {label} | skipped: the {args.minutes:g} minutes (--minutes) are spent |")
    return True

# -----------------------------------------------------------------------------
# --mode=kernels: each fused op of kernels.py against its reference, eager and compiled


def kernel_cases(device, tokens=(8192, 32768), widths=(2048, 4096), vocabs=(50304, 128256), D=128):
    # (op, size, inputs(), call(op, *inputs)) in bf16 at Llama-like sizes: tokens x width, D the head size
    import math

    import torch

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


def measure(fn, leaves, device):
    # (median ms, peak MB above what was allocated before, or None on a CPU), or None when out of memory
    import torch
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
        from triton.testing import do_bench
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


def kernel_table(cases, device, compiled=True):
    # each case eager, compiled (unless not compiled) and fused, forward and forward+backward: a Markdown table
    import torch

    import kernels
    torch._dynamo.config.recompile_limit = 64  # the compiled references recompile for every size
    print("linear_cross_entropy computes its gradients in forward: compare it on fwd+bwd\n")
    print("| op | size | pass | eager ms | compiled ms | triton ms | speedup vs eager | vs compiled "
          "| eager MB | compiled MB | triton MB |\n" + "| --- " * 11 + "|")
    for name, size, make_inputs, call in cases:
        if out_of_time(f"{name} | {size}"):
            continue
        ref = getattr(kernels, name + "_ref")
        impls = [ref, torch.compile(ref, dynamic=False) if compiled else None, getattr(kernels, name)]
        inputs = make_inputs()
        leaves = [t for t in inputs if t.requires_grad]
        with torch.no_grad():  # the output's shape, from the op that needs the least memory
            dy = torch.randn_like(call(impls[2], *inputs))
        for pass_ in ("fwd", "fwd+bwd"):
            if pass_ == "fwd":
                results = [measure(lambda f=f: call(f, *inputs), leaves, device) if f else None for f in impls]
            else:
                results = [measure(lambda f=f: call(f, *inputs).backward(dy), leaves, device) if f else None
                           for f in impls]
            ms = [f"{r[0]:.3f}" if r else "OOM" if f else "-" for r, f in zip(results, impls)]
            mb = [f"{r[1]:,.0f}" if r and r[1] is not None else "OOM" if f and not r else "-"
                  for r, f in zip(results, impls)]
            ratio = [f"{r[0] / results[2][0]:.2f}" if r and results[2] else "-" for r in results[:2]]
            print(f"| {name} | {size} | {pass_} | {' | '.join(ms)} | {' | '.join(ratio)} | {' | '.join(mb)} |")
        del inputs, leaves, dy
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def bench_kernels():
    # bf16 at Llama-like sizes; forward, and forward+backward; median time and peak memory
    import torch

    import kernels
    if not torch.cuda.is_available():
        sys.exit("bench.py: --mode=kernels measures Triton kernels on a CUDA GPU, and none is visible here")
    if not kernels.HAS_TRITON:
        sys.exit("bench.py: --mode=kernels needs Triton: pip install triton")
    import triton
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    kernel_table(kernel_cases("cuda"), "cuda")


if args.mode == "kernels":
    bench_kernels()
    sys.exit(0)

# -----------------------------------------------------------------------------
# --mode=memory: memory.memory_estimate for a config (train.py's defaults, the config file, --key=value) in
# the layouts a run on 1, 8 or 64 GPUs could take; the model is built on the meta device, so nothing is
# allocated and no GPU is needed. The run is assumed on GPUs: bf16 where dtype is auto, the kernels on.


def train_defaults():
    # train.py's settings and their defaults, read from its source (running it would start a run)
    import ast
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")) as f:
        tree = ast.parse(f.read())
    config = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "config_keys":  # the end of the defaults
                break
            config[node.targets[0].id] = ast.literal_eval(node.value)
    return config


def planned_model(overrides):
    # (settings, model on the meta device, dtype) of a train.py run with these overrides: GPU settings (bf16
    # where dtype is auto, the kernels on) unless it runs on a CPU
    import torch
    from configurator import configure
    from hf import config_from_hf, read_json
    from lora import add_lora
    from model import GPT, GPTConfig
    from meta import read_meta
    config = train_defaults()
    configure(config, overrides)
    g = argparse.Namespace(**config)
    on_cpu = g.device == "cpu"
    dtype = ("float32" if on_cpu else "bfloat16") if g.dtype == "auto" else g.dtype
    if g.init_from not in ("scratch", "resume", "auto"):  # a Hugging Face folder: its shape
        try:
            shape = config_from_hf(read_json(os.path.join(g.init_from, "config.json")), g.block_size)
        except (ValueError, KeyError) as e:
            sys.exit(f"bench.py: {e}")
    else:
        vocab = g.vocab_size
        if not vocab:  # the dataset's, padded as train.py pads it; GPT-2's without one
            have_data = os.path.exists(os.path.join(g.data_dir, "meta.json"))
            vocab = 64 * -(-read_meta(g.data_dir)["vocab_size"] // 64) if have_data else 50304
        shape = GPTConfig(n_layer=g.n_layer, n_head=g.n_head, n_kv_head=g.n_kv_head, n_embd=g.n_embd,
                          block_size=g.block_size, vocab_size=vocab, tie_embeddings=g.tie_embeddings)
    shape.use_kernels = not on_cpu if g.use_kernels is None else g.use_kernels  # a GPU's default, with Triton
    with torch.device("meta"):
        model = GPT(shape)
        if g.lora_rank:  # the frozen base in the dtype it computes in (nf4: counted at its size)
            base = dtype if g.lora_base_dtype in ("auto", "nf4", "int8") else g.lora_base_dtype
            add_lora(model.to(getattr(torch, base)), g.lora_rank, g.lora_alpha, g.lora_dropout, g.lora_targets)
    return g, model, dtype


def bench_memory():
    from memory import memory_estimate, memory_layout, memory_table
    g, model, dtype = planned_model(train_args)
    shape = model.config
    layouts = [(1, dict()), (1, dict(checkpointing=True)),
               (1, dict(fsdp=True, checkpointing=True, offload=True))]
    for gpus in (8, 64):
        layouts += [(gpus, dict(dp=gpus)), (gpus, dict(dp=gpus, fsdp=True)),
                    (gpus, dict(dp=gpus, fsdp=True, checkpointing=True))]
        # tensor parallel within a node of 8 GPUs, over as many as the heads divide among (train.py refuses
        # it for LoRA and Muon)
        tp = max(t for t in (8, 4, 2, 1) if shape.n_head % t == 0 and shape.n_kv_head % t == 0)
        if tp > 1 and not g.lora_rank and g.optimizer != "muon":
            layouts.append((gpus, dict(dp=gpus // tp, tp=tp, fsdp=True, checkpointing=True)))  # TP brings FSDP
        layouts.append((gpus, dict(dp=gpus, fsdp=True, checkpointing=True, offload=True)))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"{model.num_params() / 1e6:,.1f}M parameters ({trained / 1e6:,.1f}M trained), {dtype}, "
          f"{g.optimizer}, micro-batch {g.batch_size} x {g.block_size} tokens per GPU")
    rows = [(f"{gpus} GPU{'s' * (gpus > 1)}: {memory_layout(**layout)}",
             memory_estimate(model, g.batch_size, g.block_size, dtype, g.optimizer,
                             quantized=g.lora_base_dtype if g.lora_base_dtype in ("nf4", "int8") else None,
                             **layout)) for gpus, layout in layouts]
    print(memory_table(rows))


if args.mode == "memory":
    bench_memory()
    sys.exit(0)

# -----------------------------------------------------------------------------
# --mode=load: peak memory of from_pretrained against reading the file into memory and then building
# a model, each in a fresh process, on a generated Llama-shaped folder of ~1 GB. safetensors reads through
# mmap, whose pages count in RSS but are the kernel's cache, dropped under pressure: the process's
# own (anonymous) memory is what a load costs, so both are sampled from /proc every 2 ms.

LOADERS = {
    "baseline (import torch and model.py)": "pass",
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
        try:
            with open(f"/proc/{proc.pid}/status") as f:
                status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("RssAnon", "VmRSS"))}
            anon, rss = max(anon, int(status["RssAnon"])), max(rss, int(status["VmRSS"]))
        except (OSError, KeyError):
            pass
        time.sleep(0.002)
    assert proc.returncode == 0, script
    return anon / 1024, rss / 1024


def bench_load():
    import torch
    from hf import save_pretrained
    from model import GPT, GPTConfig
    with tempfile.TemporaryDirectory() as folder:
        shape = dict(vocab_size=32000, block_size=2048, n_layer=16, n_head=16, n_embd=1024, mlp_hidden=2816)
        save_pretrained(GPT(GPTConfig(**shape)), folder)
        size = os.path.getsize(os.path.join(folder, "model.safetensors")) / 2**20
        print(f"folder: {size:,.0f} MB of fp32 weights, torch {torch.__version__}")
        print("| load | peak anonymous MB | above baseline | peak RSS MB (with mmap'd file pages) |\n"
              "| --- | --- | --- | --- |")
        baseline = None
        for name, code in LOADERS.items():
            script = f"from model import GPT, GPTConfig\nfrom hf import load_pretrained\nfolder, shape = {folder!r}, {shape!r}\n{code}\nimport time; time.sleep(0.1)"
            anon, rss = peak_memory(script)
            baseline = baseline or anon
            print(f"| {name} | {anon:,.0f} | {anon - baseline:,.0f} | {rss:,.0f} |")


if args.mode == "load":
    bench_load()
    sys.exit(0)

# -----------------------------------------------------------------------------
# --mode=lora: a few steps of full fine-tuning, LoRA and QLoRA of the same random Qwen3-0.6B-shaped
# folder, side by side, each a real train.py run: its optimizer state (from its checkpoint), the
# frozen base's weights, the peak memory it logged and its tokens/s. Any other --key=value goes to train.py.

FINETUNES = {"full": [], "LoRA": ["--lora_rank=16"], "LoRA, int8 base": ["--lora_rank=16", "--lora_base_dtype=int8"],
             "QLoRA": ["--lora_rank=16", "--lora_base_dtype=nf4"]}
QWEN3_06B = dict(vocab_size=151936, block_size=4096, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024,
                 head_size=128, mlp_hidden=3072, qk_norm=True, family="qwen3")


def random_folder(shape, folder):
    # a Hugging Face folder of random bf16 weights (as the Hub holds them), built on the meta device and filled
    # in place: no fp32 copy of a 7B model on the way
    import torch
    from hf import save_pretrained
    from model import GPT, GPTConfig
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


def bench_lora(shape=QWEN3_06B, name="Qwen3-0.6B", extra_args=(), skip=(), scratch=None, steps=10):
    # each of FINETUNES but those in skip, for steps steps (more than 3: the tokens/s of the steps after the
    # first two), in a temporary folder under scratch
    import torch
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        random_folder(shape, f"{tmp}/model")
        vocab = shape["vocab_size"] - 1  # the last id is end-of-text
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            rng.integers(0, vocab, size=200_000, dtype=np.uint32).tofile(f"{tmp}/{split}.bin")
        with open(f"{tmp}/meta.json", "w") as f:
            json.dump({"dtype": "uint32", "vocab_size": vocab, "eot_id": vocab}, f)
        settings = " ".join([*train_args, *extra_args]) or "train.py defaults"
        print(f"{name} shape, torch {torch.__version__}, {settings}, {steps} steps\n")
        print("| fine-tune | trained parameters | optimizer state MB | frozen base MB | peak memory MB "
              "| tokens/s |\n" + "| --- " * 6 + "|")
        for label, extra in FINETUNES.items():
            if label in skip or out_of_time(label):
                continue
            out = f"{tmp}/out_{label}"
            cmd = [sys.executable, "train.py", f"--init_from={tmp}/model", f"--data_dir={tmp}", f"--out_dir={out}",
                   f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=1", "--log_interval=1",
                   *train_args, *extra_args, *extra]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:  # out of memory, or torchao missing: one line, and the next goes on
                print(f"| {label} | failed: {done.stdout.strip().splitlines()[-1][:200]} |")
            else:
                print(finetune_row(label, out, extra))
            shutil.rmtree(out, ignore_errors=True)  # its checkpoint, read: a 7B one fills a disk


def finetune_row(label, out, extra):
    # a fine-tuning run's row: what its checkpoint holds (optimizer state, the frozen base as it ran) and what it
    # logged (the peak memory, the median tokens/s after the first two steps, which hold the warm-up)
    import torch
    from checkpoint import model_from_checkpoint
    from lora import quantize_base
    from memory import tensor_bytes
    ckpt = torch.load(f"{out}/ckpt.pt", weights_only=True, mmap=True)
    state = sum(tensor_bytes(t) for s in ckpt["optimizer"]["state"].values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    ckpt["optimizer"] = None
    model = model_from_checkpoint(ckpt, torch.bfloat16)  # a LoRA run's frozen base, in bf16 as it ran
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
            f"| {speed:,.0f} |")


if args.mode == "lora":
    bench_lora()
    sys.exit(0)

# -----------------------------------------------------------------------------
# --mode=sft: what the assistant-only mask buys on a task whose answers are known (reverse 3-5 of 30 words), in
# exact match on held-out prompts after the same --steps; and the real tokens of packed sequences on a chat set
# of long-tailed lengths, against one example per sequence


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
    import torch
    from checkpoint import load_run
    model, tokenizer, _ = load_run(os.path.join(out_dir, "ckpt.pt"), torch.float32)
    right = 0
    for pick in prompts:
        text = f"<|user|>\nreverse: {' '.join(pick)}\n<|assistant|>\n"  # the built-in template's prompt
        ids = tokenizer.encode_chat(text, [])[0].tolist()
        out = model.eval().generate(torch.tensor([ids]), 16, temperature=0, stop=tokenizer.eot_id)[0, len(ids):]
        out = out.tolist()
        right += tokenizer.decode(out[:out.index(tokenizer.eot_id)] if tokenizer.eot_id in out else out) == \
            " ".join(reversed(pick))
    return right / len(prompts)


def bench_sft():
    from data import Split
    from meta import read_meta
    rng, seen = np.random.default_rng(0), set()
    shape = ["--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=128", "--batch_size=16", "--device=cpu",
             "--learning_rate=1e-3", "--min_lr=1e-4", "--warmup_iters=50", f"--lr_decay_iters={args.steps}",
             f"--max_iters={args.steps}", f"--eval_interval={args.steps}", "--sequences=examples", *train_args]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reversal_chats(os.path.join(tmp, "train.jsonl"), 4000, rng, seen)
        held_out = reversal_chats(os.path.join(tmp, "test.jsonl"), 200, rng, seen)
        for train_on in ("assistant", "all"):
            data, out = os.path.join(tmp, f"data_{train_on}"), os.path.join(tmp, f"out_{train_on}")
            for cmd in (["prepare.py", os.path.join(tmp, "train.jsonl"), "--val_input", os.path.join(tmp, "test.jsonl"),
                         "--tokenizer=bpe:512", f"--train_on={train_on}", f"--out_dir={data}"],
                        ["train.py", f"--data_dir={data}", f"--out_dir={out}", *shape]):
                done = subprocess.run([sys.executable, *cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
                if done.returncode:
                    sys.exit(f"bench.py: {cmd[0]} failed:\n{done.stdout[-3000:]}")
            with open(os.path.join(out, "metrics.jsonl")) as f:
                val_loss = [json.loads(line) for line in f][-1]["val_loss"]
            rows.append((train_on, val_loss, exact_match(out, held_out)))
        # packing: answers of 5-300 words (tokens), log-normal lengths (median ~30), in sequences of 256
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
        packed, padded = real / (train.sequences_in(1) * 257), real / (len(train.lengths) * 257)
    print(f"reverse 3-5 words: 4,000 conversations, 200 held out, {args.steps} steps each")
    print("| trained on | val loss (its own targets) | exact match, held out |\n| --- | --- | --- |")
    for train_on, val_loss, match in rows:
        print(f"| {train_on} | {val_loss:.4f} | {match:.1%} |")
    print(f"packing {len(train.lengths):,} conversations of long-tailed lengths into sequences of 256: real "
          f"tokens {packed:.1%} packed, {padded:.1%} one example per sequence ({packed / padded:.2f}x)")


if args.mode == "sft":
    bench_sft()
    sys.exit(0)

# -----------------------------------------------------------------------------
# train.py's throughput (or, racing, the loss it reaches in equal time), once per run


def run_train(extra, out_dir, steps, evaluate=False, log_interval=None):
    # train.py's own log records; without evaluate, only one at the start, on a single batch
    evals = [f"--eval_interval={steps + 1}", "--eval_iters=1", "--log_interval=1"]
    if evaluate:
        evals = [f"--eval_interval={steps}", f"--lr_decay_iters={steps}",
                 f"--log_interval={log_interval or steps}"]
    cmd = [sys.executable, "train.py", *train_args, *extra, f"--out_dir={out_dir}", f"--max_iters={steps}",
           *evals, "--always_save_checkpoint=False"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"bench.py: train.py failed:\n{done.stdout[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    shutil.rmtree(out_dir, ignore_errors=True)  # its checkpoint: a measurement keeps nothing of a run but its log
    return records


def throughput(extra, out_dir, steps=None, warmup=None):
    steps, warmup = steps or args.steps, warmup or args.warmup
    records = run_train(extra, out_dir, steps)
    records = [r for r in records if "tokens_per_s" in r and r["iter"] > warmup]
    keys = ("tokens_per_s", "ms_per_iter", "mfu", "mfu_run")
    med = {k: statistics.median(r.get(k) or 0 for r in records) for k in keys}
    return med, max(r["mem_mb"] for r in records)


def matmul_peak(cuda):
    # The FLOP/s one large matmul reaches here (bf16 on a GPU, fp32 on a CPU): the ceiling a training step can
    # really approach, beside the datasheet's (an H100 SXM's bf16 matmul reaches ~80% of its 989 TFLOP/s).
    import torch
    n, dtype, device = (8192, torch.bfloat16, "cuda") if cuda else (512, torch.float32, "cpu")
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    ms, _ = measure(lambda: a @ b, [], device)
    return 2 * n ** 3 / (ms / 1000)


def race(extra, out_dir):
    # as many steps as --seconds hold at the speed just measured, the whole schedule fitted to them
    med, _ = throughput(extra, out_dir + "_timing")
    steps = max(1, round(args.seconds * 1000 / med["ms_per_iter"]))
    records = run_train(extra, out_dir, steps, evaluate=True)
    last = [r for r in records if "val_loss" in r][-1]
    seconds = [r for r in records if "ms_per_iter" in r][-1]["ms_per_iter"] * steps / 1000  # eval excluded
    return {"ms_per_iter": med["ms_per_iter"], "steps": steps, "seconds": seconds, "val_loss": last["val_loss"],
            "val_accuracy": last["val_accuracy"]}


# -----------------------------------------------------------------------------
# --mode=gpu: everything a GPU must show (BENCHMARKS.md, "GPU: owed"), made of the modes above at a GPU's
# shapes, in sections that run alone (--section), each a few minutes long: a GPU machine is lent for 30
# minutes at a time, in calls of at most 10. With --out=DIR each section writes DIR/SECTION.md line by line, so
# that a call stopped at its limit still returns what it finished. A row that cannot run (out of memory,
# flash-attn or torchao not installed) is one line, and the rest go on. --tiny runs the same at tiny shapes on a
# CPU, a smoke check of the command, without torch.compile (its first compile costs ~20 s a graph on a CPU).

GPU_SECTIONS = ("kernels", "step", "memory", "optimizers", "finetune", "tests")
GPT2_124M = ["config/train_gpt2.py", "--batch_size=16", "--gradient_accumulation_steps=1", "--eval_iters=10"]
NEAR_1B = [*GPT2_124M, "--n_layer=20", "--n_head=32", "--n_kv_head=8", "--n_embd=2048", "--batch_size=8"]
LLAMA2_7B = dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096, mlp_hidden=11008,
                 tie_embeddings=False)
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--block_size=64", "--batch_size=2", "--eval_iters=2",
        "--gradient_accumulation_steps=1", "--device=cpu", "--compile=False"]
TINY_QWEN3 = dict(QWEN3_06B, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, head_size=32, mlp_hidden=128,
                  vocab_size=512)
# a config file for train.py that hides flash-attn from model.py, leaving attention to SDPA
NO_FLASH = "import model as _model\n_model.flash_attn_func = None\n"


def attempt(label, measure_fn, *a, **kw):
    # one row's measurement, or one line saying why there is none; run_train stops bench.py when train.py
    # fails, and that stop is caught here so that the rest go on
    if out_of_time(label):
        return None
    try:
        return measure_fn(*a, **kw)
    except SystemExit as e:
        print(f"| {label} | failed: {str(e.code).strip().splitlines()[-1][:200]} |")


@contextlib.contextmanager
def written_to(path):
    # what print() writes goes to the terminal and, given a path, to that file too, each write flushed: a call
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
    # a section's temporary files, in a folder of a fixed name removed at its end and at its start: a call
    # stopped at its limit leaves its files behind, and the warm machine's disk (64 GB) is the next call's
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
    # from it (GPT-2's encoding is a download the GPU machine cannot make); --tiny: the json package alone
    import sysconfig
    data = os.path.join(folder, "stdlib")
    corpus = [os.path.join(sysconfig.get_paths()["stdlib"], "json")] if tiny else []
    cmd = [sys.executable, "prepare.py", *corpus, f"--tokenizer=bpe:{512 if tiny else 8192}", f"--out_dir={data}"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"bench.py: prepare.py failed:\n{done.stdout[-3000:]}")
    return data


def report_commit():
    # --commit, else git describe in a checkout, else the file wheels.py wrote beside the wheels carried along
    here = os.path.dirname(os.path.abspath(__file__))
    if args.commit:
        return args.commit
    if shutil.which("git") and os.path.exists(os.path.join(here, ".git")):
        git = ["git", "describe", "--always", "--dirty"]  # the commit, and -dirty for uncommitted changes
        return subprocess.run(git, capture_output=True, text=True, cwd=here).stdout.strip() or "unknown"
    if os.path.exists(os.path.join(here, "wheels", "COMMIT")):
        with open(os.path.join(here, "wheels", "COMMIT")) as f:
            return f.read().strip() + " (wheels/COMMIT)"
    return "unknown (pass --commit=)"


def gpu_header(cuda, section):
    import datetime

    import torch

    import kernels
    triton = kernels.triton.__version__ if kernels.HAS_TRITON else "not installed"
    device = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores, tiny shapes (--tiny)"
    print(f"## {datetime.date.today()}, GPU: {device} (python bench.py --mode=gpu --section={section})\n")
    print(f"torch {torch.__version__}, Triton {triton}, CUDA {torch.version.cuda}, commit {report_commit()}\n")


def section_kernels(cuda, scratch):
    import kernels
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


def section_step(cuda, scratch):
    # tokens/s, MFU and peak memory of a step: the kernels and compile on and off, flash-attn against SDPA,
    # doc_mask's FlexAttention against plain causal SDPA
    import model
    print(f"### GPT-2 124M training step ({args.steps} steps, medians after {args.warmup})\n")
    documents(scratch)
    shape = [*(GPT2_124M if cuda else TINY), f"--data_dir={scratch}"]
    with open(os.path.join(scratch, "no_flash.py"), "w") as f:
        f.write(NO_FLASH)
    on = [f"--compile={cuda}", "--use_kernels=True"]
    runs = [(f"kernels {k}, {'compiled' if c else 'eager'}", [f"--use_kernels={k == 'on'}", f"--compile={c}"])
            for c in sorted({False, cuda}) for k in ("off", "on")]
    sdpa = [os.path.join(scratch, "no_flash.py"), *on]
    if model.flash_attn_func is None:  # the run with the kernels on is SDPA's already
        print("flash-attn is not installed here (pip install flash-attn): attention is SDPA's in the runs above "
              "doc_mask's\n")
    else:
        runs += [("flash-attn", on), ("SDPA, causal", sdpa)]
    runs.append(("SDPA or FlexAttention (CUDA), doc_mask", [*sdpa, "--doc_mask=True"]))
    import torch
    from parallel import peak_flops
    datasheet, measured = peak_flops("cuda" if cuda else "cpu", torch.bfloat16), matmul_peak(cuda)
    print(f"MFU in PaLM's convention (every query against all T keys, as nanoGPT and nanochat report it) and of "
          f"the FLOPs run (causal; within documents under doc_mask), against the datasheet's peak "
          f"({(datasheet or 0) / 1e12:.3g} TFLOP/s); the last column against the {measured / 1e12:.3g} TFLOP/s "
          f"a {'bf16' if cuda else 'fp32'} matmul reaches here\n")
    print("| run | tokens/s | ms/iter | MFU PaLM | MFU run | MFU PaLM, measured peak | peak memory MB |\n"
          "| --- | --- | --- | --- | --- | --- | --- |")
    for i, (label, extra) in enumerate(runs):
        result = attempt(label, throughput, [*shape, *extra], f"{scratch}/step{i}")
        if result:
            med, mem = result
            mfus = [f"{med[k]:.1%}" if med[k] else "n/a" for k in ("mfu", "mfu_run")]
            mfus.append(f"{med['mfu'] * datasheet / measured:.1%}" if med["mfu"] and datasheet else "n/a")
            print(f"| {label} | {med['tokens_per_s']:,.0f} | {med['ms_per_iter']:.1f} | {' | '.join(mfus)} | "
                  f"{mem:,.0f} |")


def section_memory(cuda, scratch):
    # memory.py's estimate against the peak train.py measures (CUDA's allocator; a CPU's peak RSS), eager as the
    # estimate is: 10 steps are enough for the peak, which the optimizer's first step reaches
    from memory import memory_estimate
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
            g, model, dtype = planned_model(run_args)
            estimate = memory_estimate(model, g.batch_size, g.block_size, dtype, g.optimizer, fsdp=g.fsdp,
                                       checkpointing=g.gradient_checkpointing, offload=g.fsdp_cpu_offload,
                                       device="cuda" if cuda else "cpu")["device"] / 2**20
            result = attempt(f"{name} | {layout}", throughput, run_args, f"{scratch}/mem_{name}{i}",
                             steps=min(args.steps, 10), warmup=min(args.warmup, 3))
            if result:
                (med, measured) = result
                print(f"| {name} | {layout} | {estimate:,.0f} | {measured:,.0f} | {measured / estimate:.2f} "
                      f"| {med['tokens_per_s']:,.0f} |")


def section_optimizers(cuda, scratch):
    # AdamW against Muon for the same steps on text that can be learned: the validation loss each reaches, and
    # its tokens/s (eager: a compile would cost more than the steps; the median of its logs after the first)
    steps = 300 if cuda else args.steps
    every = max(1, steps // 10)
    print(f"### AdamW against Muon at 124M, on this Python's standard library (prepare.py's default corpus, "
          f"bpe:{8192 if cuda else 512})\n")
    data = stdlib_tokens(scratch, tiny=not cuda)
    print(f"{steps} steps each\n\n| optimizer | val loss | tokens/s |\n| --- | --- | --- |")
    for name in ("adamw", "muon"):
        run_args = [*(GPT2_124M if cuda else TINY), f"--data_dir={data}", "--compile=False",
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
    import torch
    from memory import memory_estimate
    from model import GPT, GPTConfig
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


def section_finetune(cuda, scratch):
    # full fine-tuning, LoRA and QLoRA of random Qwen3-0.6B- and Llama-2-7B-shaped folders, each row a train.py
    # run of 10 steps; what cannot run here is said in one line before anything is built. At 7B the int8 base
    # is left out: its row would quantize 7B weights on the CPU again to count them, a minute of the lease
    print("### Fine-tuning: full, LoRA and QLoRA at micro-batch 1\n")
    skip = []
    if importlib.util.find_spec("torchao") is None:
        print("torchao is not installed (python wheels.py here, and carry wheels/): the int8 and QLoRA rows are "
              "left out\n")
        skip = ["LoRA, int8 base", "QLoRA"]
    if not cuda:
        bench_lora(TINY_QWEN3, "tiny Qwen3", ["--batch_size=1", "--block_size=32", "--device=cpu"], skip, scratch)
        return
    bench_lora(QWEN3_06B, "Qwen3-0.6B", ["--batch_size=1", "--block_size=1024"], skip, scratch)
    print()
    reason = full_finetune_room(LLAMA2_7B, scratch)
    if reason:
        print(f"full fine-tuning of Llama-2-7B is left out: {reason}\n")
    skip_7b = [*skip, "LoRA, int8 base", *["full"] * bool(reason)]
    bench_lora(LLAMA2_7B, "Llama-2-7B", ["--batch_size=1", "--block_size=1024"], skip_7b, scratch)


def pytest_summary(label, pytest_args, env):
    # one tier of the tests in a process of its own session (its workers end with it at the deadline): its
    # summary line and its failures' lines
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **env}, start_new_session=True)
    try:
        lines = proc.communicate(timeout=max(1.0, deadline - time.time()))[0].strip().splitlines()
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        lines = [f"stopped: the {args.minutes:g} minutes (--minutes) were spent"]
    summary = lines[-1] if lines else "no output"
    if proc.returncode == 5:  # no test collected: a tier this commit does not have
        summary = f"no test here is marked for it ({summary})"
    print(f"| {label} | {summary} | {(time.time() - started) / 60:.1f} |")
    for line in [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20]:
        print(f"| | {line[:200]} | |")


def section_tests(cuda, scratch):
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


def bench_gpu():
    global deadline
    import torch
    cuda = not args.tiny
    if cuda and not torch.cuda.is_available():
        sys.exit("bench.py: --mode=gpu measures a CUDA GPU and none is visible here (add --tiny for a smoke "
                 "check on CPU)")
    sections = GPU_SECTIONS if args.section == "all" else args.section.split(",")
    if not set(sections) <= set(GPU_SECTIONS):
        sys.exit(f"bench.py: --section={args.section}: choose among {', '.join(GPU_SECTIONS)} (comma-separated)")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    run = {"kernels": section_kernels, "step": section_step, "memory": section_memory,
           "optimizers": section_optimizers, "finetune": section_finetune, "tests": section_tests}
    deadline = time.time() + 60 * args.minutes
    for name in sections:
        started = time.time()
        with written_to(os.path.join(args.out, f"{name}.md") if args.out else None), \
                scratch_folder(name) as scratch:
            gpu_header(cuda, name)
            run[name](cuda, scratch)
            print(f"\n({name}: {(time.time() - started) / 60:.1f} minutes)\n")


if args.mode == "gpu":
    bench_gpu()
    sys.exit(0)

if args.run:
    runs = [shlex.split(r) for r in args.run]
else:
    runs = [[f"--{args.compare}={v}"] for v in args.values.split(",")]
with tempfile.TemporaryDirectory() as tmp:
    if args.synthetic:
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            rng.integers(0, 50257, size=2_000_000, dtype=np.uint16).tofile(os.path.join(tmp, f"{split}.bin"))
        train_args.append(f"--data_dir={tmp}")  # no meta.json: read as GPT-2 tokens
    rows = []
    for i, extra in enumerate(runs):
        name = " ".join(e.removeprefix("--") for e in extra)
        rows.append((name, (race if args.mode == "race" else throughput)(extra, os.path.join(tmp, f"out_{i}"))))

if args.mode == "race":
    print(f"\n{' '.join(train_args)}, {args.seconds:g} s of training each (timed on {args.steps} steps)")
    print("| run | ms/iter | steps | training s | val loss | val accuracy |\n" + "| --- " * 6 + "|")
    for name, r in rows:
        print(f"| {name} | {r['ms_per_iter']:.1f} | {r['steps']} | {r['seconds']:.1f} | {r['val_loss']:.4f} "
              f"| {r['val_accuracy']:.1%} |")
    sys.exit(0)
print(f"\n{' '.join(train_args)}, {args.steps} steps, medians after {args.warmup}")
print("| run | tokens/s | ms/iter | MFU | peak memory MB |\n| --- | --- | --- | --- | --- |")
for name, (med, mem) in rows:
    mfu = f"{med['mfu']:.1%}" if med["mfu"] else "n/a"
    print(f"| {name} | {med['tokens_per_s']:,.0f} | {med['ms_per_iter']:.1f} | {mfu} | {mem:,.0f} |")
for name, (med, _) in rows[1:]:
    print(f"speedup of {name}: {med['tokens_per_s'] / rows[0][1][0]['tokens_per_s']:.2f}x")
