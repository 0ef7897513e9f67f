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

--synthetic trains on random tokens (no prepared data needed); any other --key=value goes to train.py.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--compare", default="compile", help="a setting of train.py to run with each of --values")
parser.add_argument("--values", default="False,True", help="comma-separated values of --compare")
parser.add_argument("--run", action="append", help="instead of --compare: --run='--key=value ...', once per run")
parser.add_argument("--seconds", type=float, default=60, help="--mode=race: training seconds per run")
parser.add_argument("--steps", type=int, default=50, help="training steps per run")
parser.add_argument("--warmup", type=int, default=10, help="first steps left out of the medians")
parser.add_argument("--synthetic", action="store_true", help="random tokens (vocab 50257) instead of data_dir")
parser.add_argument("--mode", choices=["train", "race", "kernels", "load", "lora", "memory", "sft"], default="train",
                    help="race: equal wall time per run; kernels: time kernels.py's ops; load: memory of "
                         "loading a Hugging Face folder; lora: memory of full, LoRA and QLoRA fine-tuning; "
                         "memory: a config's memory per GPU on 1, 8 and 64 GPUs, estimated without a GPU; "
                         "sft: a task's exact match trained on answers only and on every token, and packing")
args, train_args = parser.parse_known_args()
if args.warmup >= args.steps:
    sys.exit(f"bench.py: --warmup={args.warmup} leaves no steps to measure of --steps={args.steps}")

# -----------------------------------------------------------------------------
# --mode=kernels: each fused op of kernels.py against its reference, eager and compiled


def bench_kernels():
    # bf16 at Llama-like sizes; forward, and forward+backward; median time and peak memory
    import math

    import torch

    import kernels

    if not torch.cuda.is_available():
        sys.exit("bench.py: --mode=kernels measures Triton kernels on a CUDA GPU, and none is visible here")
    if not kernels.HAS_TRITON:
        sys.exit("bench.py: --mode=kernels needs Triton: pip install triton")
    import triton
    from triton.testing import do_bench

    torch._dynamo.config.recompile_limit = 64  # the compiled references recompile for every size

    def rand(*shape, std=1.0, grad=True):
        return (std * torch.randn(*shape, device="cuda", dtype=torch.bfloat16)).requires_grad_(grad)

    def rotary_inputs(N, C, D=128, T=2048):  # q as a strided view into a wider tensor (the model's is contiguous)
        angles = torch.outer(torch.arange(T, device="cuda").float(), torch.rand(D // 2, device="cuda"))
        return [rand(N // T, T, 3 * C), angles.cos(), angles.sin()]

    def rotary_call(f, qkv, cos, sin, D=128):
        B, T, C3 = qkv.shape
        return f(qkv[..., :C3 // 3].view(B, T, C3 // 3 // D, D), cos, sin)

    cases = []  # (op, size, inputs(), call(op, *inputs))
    for N in (8192, 32768):
        for C in (2048, 4096):
            H = 64 * math.ceil(8 * C / 3 / 64)  # the model's SwiGLU width
            cases += [
                ("rms_norm", f"{N}x{C}", lambda N=N, C=C: [rand(N, C), rand(C)], lambda f, x, w: f(x, w, 1e-5)),
                ("swiglu", f"{N}x{H}", lambda N=N, H=H: [rand(N, 2 * H)], lambda f, gu: f(*gu.chunk(2, -1))),
                ("apply_rotary", f"{N}x{C}", lambda N=N, C=C: rotary_inputs(N, C), rotary_call),
            ]
    for V in (50304, 128256):
        for N in (8192, 32768):
            for C in (2048, 4096):
                inputs = lambda N=N, C=C, V=V: [rand(N, C), rand(V, C, std=0.02),
                                                torch.randint(0, V, (N,), device="cuda")]
                cases.append(("linear_cross_entropy", f"{N}x{C} V={V}", inputs, lambda f, *a: f(*a)))

    def measure(fn, leaves):
        # (median ms, peak MB above what was allocated before), or None when out of memory
        try:
            fn()  # warm up: compile, autotune, cache
            for t in leaves:
                t.grad = None
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
            torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    print("linear_cross_entropy computes its gradients in forward: compare it on fwd+bwd")
    print("| op | size | pass | eager ms | compiled ms | triton ms | speedup vs eager | vs compiled "
          "| eager MB | compiled MB | triton MB |\n" + "| --- " * 11 + "|")
    for name, size, make_inputs, call in cases:
        ref = getattr(kernels, name + "_ref")
        impls = [ref, torch.compile(ref, dynamic=False), getattr(kernels, name)]
        inputs = make_inputs()
        leaves = [t for t in inputs if t.requires_grad]
        with torch.no_grad():  # the output's shape, from the op that needs the least memory
            dy = torch.randn_like(call(impls[2], *inputs))
        for pass_ in ("fwd", "fwd+bwd"):
            if pass_ == "fwd":
                results = [measure(lambda f=f: call(f, *inputs), leaves) for f in impls]
            else:
                results = [measure(lambda f=f: call(f, *inputs).backward(dy), leaves) for f in impls]
            ms = [f"{r[0]:.3f}" if r else "OOM" for r in results]
            mb = [f"{r[1]:,.0f}" if r else "OOM" for r in results]
            ratio = [f"{r[0] / results[2][0]:.2f}" if r and results[2] else "-" for r in results[:2]]
            print(f"| {name} | {size} | {pass_} | {' | '.join(ms)} | {' | '.join(ratio)} | {' | '.join(mb)} |")
        del inputs, leaves, dy
        torch.cuda.empty_cache()


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


def bench_memory():
    import torch
    from configurator import configure
    from hf import config_from_hf, read_json
    from lora import add_lora
    from memory import memory_estimate, memory_layout, memory_table
    from model import GPT, GPTConfig
    from tokenizer import read_meta
    config = train_defaults()
    configure(config, train_args)
    g = argparse.Namespace(**config)
    dtype = "bfloat16" if g.dtype == "auto" else g.dtype
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
    shape.use_kernels = True if g.use_kernels is None else g.use_kernels  # a GPU's default, with Triton
    with torch.device("meta"):
        model = GPT(shape)
        if g.lora_rank:  # the frozen base in the dtype it computes in (nf4: counted at its size)
            base = dtype if g.lora_base_dtype in ("auto", "nf4", "int8") else g.lora_base_dtype
            add_lora(model.to(getattr(torch, base)), g.lora_rank, g.lora_alpha, g.lora_dropout, g.lora_targets)
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
# frozen base's weights and the peak memory it logged. Any other --key=value goes to train.py.

FINETUNES = {"full": [], "LoRA": ["--lora_rank=16"], "LoRA, int8 base": ["--lora_rank=16", "--lora_base_dtype=int8"],
             "QLoRA": ["--lora_rank=16", "--lora_base_dtype=nf4"]}


def bench_lora():
    import torch
    from checkpoint import model_from_checkpoint
    from hf import save_pretrained
    from lora import quantize_base
    from memory import tensor_bytes
    from model import GPT, GPTConfig
    shape = dict(vocab_size=151936, block_size=4096, n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_size=128,
                 mlp_hidden=3072, qk_norm=True, family="qwen3")
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(GPT(GPTConfig(**shape)).to(torch.bfloat16), f"{tmp}/model")  # as the Hub holds it: bf16
        rng = np.random.default_rng(0)
        for split in ("train", "val"):
            rng.integers(0, 151643, size=200_000, dtype=np.uint32).tofile(f"{tmp}/{split}.bin")
        with open(f"{tmp}/meta.json", "w") as f:
            json.dump({"dtype": "uint32", "vocab_size": 151643, "eot_id": 151643}, f)
        print(f"Qwen3-0.6B shape, torch {torch.__version__}, {' '.join(train_args) or 'train.py defaults'}")
        print("| fine-tune | trained parameters | optimizer state MB | frozen base MB | peak memory MB |\n"
              "| --- | --- | --- | --- | --- |")
        for name, extra in FINETUNES.items():
            out = f"{tmp}/out_{name}"
            cmd = [sys.executable, "train.py", f"--init_from={tmp}/model", f"--data_dir={tmp}", f"--out_dir={out}",
                   "--max_iters=3", "--eval_interval=3", "--eval_iters=1", "--log_interval=1", *train_args, *extra]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode:
                sys.exit(f"bench.py: train.py failed:\n{done.stdout[-3000:]}")
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
                peak = max(json.loads(line).get("mem_mb", 0) for line in f)
            print(f"| {name} | {trained / 1e6:,.1f}M | {state / 2**20:,.0f} | {frozen / 2**20:,.0f} | {peak:,.0f} |")
            del ckpt, model  # before the next run: the full fine-tune's weights alone are 2.4 GB


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
    from tokenizer import read_meta
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


def run_train(extra, out_dir, steps, evaluate=False):
    # train.py's own log records; without evaluate, only one at the start, on a single batch
    evals = [f"--eval_interval={steps}", f"--lr_decay_iters={steps}", f"--log_interval={steps}"] if evaluate \
        else [f"--eval_interval={steps + 1}", "--eval_iters=1", "--log_interval=1"]
    cmd = [sys.executable, "train.py", *train_args, *extra, f"--out_dir={out_dir}", f"--max_iters={steps}",
           *evals, "--always_save_checkpoint=False"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode:
        sys.exit(f"bench.py: train.py failed:\n{done.stdout[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def throughput(extra, out_dir):
    records = run_train(extra, out_dir, args.steps)
    records = [r for r in records if "tokens_per_s" in r and r["iter"] > args.warmup]
    med = {k: statistics.median(r[k] or 0 for r in records) for k in ("tokens_per_s", "ms_per_iter", "mfu")}
    return med, max(r["mem_mb"] for r in records)


def race(extra, out_dir):
    # as many steps as --seconds hold at the speed just measured, the whole schedule fitted to them
    med, _ = throughput(extra, out_dir + "_timing")
    steps = max(1, round(args.seconds * 1000 / med["ms_per_iter"]))
    records = run_train(extra, out_dir, steps, evaluate=True)
    last = [r for r in records if "val_loss" in r][-1]
    seconds = [r for r in records if "ms_per_iter" in r][-1]["ms_per_iter"] * steps / 1000  # eval excluded
    return {"ms_per_iter": med["ms_per_iter"], "steps": steps, "seconds": seconds, "val_loss": last["val_loss"],
            "val_accuracy": last["val_accuracy"]}


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
