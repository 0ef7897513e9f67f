"""
Train a GPT on token files made by prepare.py. One process on a CPU, a GPU or an Apple chip:

    python train.py config/train_small.py
    python train.py config/train_small.py --batch_size=32 --compile=False

DDP over 8 GPUs on one node, or over several nodes (run the same line on each, with its rank):

    torchrun --standalone --nproc_per_node=8 train.py config/train_small.py
    torchrun --nnodes=4 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 train.py config/train_small.py

Past one device's memory add --fsdp=True, --tp_size=N, --gradient_checkpointing=True (README: Scaling up).

Continue a run from out_dir/ckpt.pt (or an FSDP run's sharded out_dir/ckpt/) exactly where it stopped: add
--init_from=resume (or use --init_from=auto, which resumes when there is a checkpoint: the same command after
every preemption).
"""

import atexit
import gc
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import checkpoint as ckpt
from bounds import check_sizes, check_token_ids
from configurator import configure
from data import Split
from files import lock_folder, unlock_folder
from hf import fingerprint, load_pretrained, read_json
from lora import add_lora, check_lora, quantize_base
from memory import measured_mb, memory_estimate, memory_layout, memory_table
from meta import check_token_files, read_meta
from model import GPT, GPTConfig, attended_keys, document_mask
from parallel import check_layout, clip_gradients, parallelize, peak_flops, pick_device
from tokenizer import check_tokenizer

# -----------------------------------------------------------------------------
# 1. settings: every one is a global here; config files and --key=value override them
# I/O
out_dir = "out"  # checkpoints and metrics.jsonl go here
eval_interval = 250  # estimate train/val loss (and maybe checkpoint) every this many steps
log_interval = 10  # print and record training metrics every this many steps
eval_iters = 50  # batches per loss estimate, per process
eval_full = False  # the val loss over every token of val.bin once, in overlapping windows (as perplexity in papers)
eval_stride = 128  # eval_full: tokens each window shares with the one before, its context (only the rest count)
eval_tasks = ""  # lm-evaluation-harness tasks to score at each evaluation, comma-separated (pip install lm_eval)
eval_tasks_limit = 0  # at most this many items of each task (0: all of them)
eval_tasks_path = ""  # a folder of task files of your own (lm_eval's --include_path)
always_save_checkpoint = True  # save at every evaluation, not only when val loss improves
init_from = "scratch"  # 'scratch', 'resume' (out_dir/ckpt.pt), 'auto' (resume if there is one), or a HF model folder
keep_last_n = 0  # also keep this many step checkpoints ckpt_NNNNNNN.pt (0: only ckpt.pt and ckpt_best.pt)
save_every_epoch = False  # also save at the end of each epoch N, and keep that as ckpt_epoch_N.pt
early_stop_patience = 0  # stop after this many evaluations without a better val loss (0: never)
early_stop_min_delta = 0.0  # an evaluation counts as better only if it lowers the best val loss by this much
max_skipped_steps = 10  # stop after this many updates in a row skipped for a non-finite loss or gradient
# logging
wandb_log = False  # also send metrics to Weights & Biases
wandb_project = "gpt"
wandb_run_name = "run"
tensorboard_log = False  # also write metrics.jsonl's records as TensorBoard events under out_dir/tb
# data
data_dir = "data/stdlib"  # train.bin, val.bin and meta.json from prepare.py
gradient_accumulation_steps = 1  # micro-steps per update, summed over all processes
batch_size = 12  # sequences per micro-step per process
block_size = 256  # tokens per sequence (from a pretrained folder: at most its max_position_embeddings)
sequences = "windows"  # 'windows': random windows (pretraining); 'examples': whole examples packed (fine-tuning)
max_epochs = 0  # also end the run after this many passes over the training split (0: max_iters alone)
# model (from a pretrained folder, its config.json sets the shape and these are ignored)
n_layer = 6
n_head = 6
n_kv_head = 0  # key/value heads for grouped-query attention (0: as many as n_head)
n_embd = 384
dropout = 0.0  # 0 for pretraining, try 0.1+ for finetuning
tie_embeddings = True  # the LM head shares the token embedding's weight
vocab_size = 0  # 0: the dataset's vocabulary, padded up to a multiple of 64
use_kernels = None  # Triton fused ops: True, False, or None for auto (on CUDA with Triton)
doc_mask = False  # attend only within a document: end-of-text (meta.json's eot_id) begins a new one
# LoRA: train low-rank adapters on a frozen pretrained model (init_from a Hugging Face folder)
lora_rank = 0  # the adapters' rank; 0: off, every weight trains
lora_alpha = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
lora_dropout = 0.0  # dropout on the adapters' input
lora_targets = "q,k,v,o,gate,up,down"  # projections to adapt; the default is all of them, attention's and the MLP's
lora_base_dtype = "auto"  # the frozen base: 'auto' (the run's dtype), 'float32', 'bfloat16', 'nf4' (QLoRA) or 'int8'
# (torchao's: 4 bits, or 8 bits weight-only)
# optimizer
optimizer = "adamw"  # 'adamw', 'muon' (Muon for the blocks' matrices, AdamW for the rest), 'adam', 'sgd'
learning_rate = 6e-4  # peak learning rate (under muon: of the AdamW part)
max_iters = 5000  # total optimizer steps
weight_decay = 0.1  # on matrices only (AdamW, Muon: decoupled; Adam, SGD: an L2 term in the gradient)
beta1 = 0.9  # Adam(W)'s
beta2 = 0.95
momentum = 0.9  # SGD's
muon_lr = 0.02  # Muon's peak learning rate for the blocks' matrices
muon_momentum = 0.95
grad_clip = 1.0  # clip gradients at this norm (0: off)
# learning rate schedule: linear warmup over warmup_iters, then lr_schedule; every learning rate
# (learning_rate, muon_lr) is scaled by the same factor, down to min_lr / learning_rate of its peak
decay_lr = True  # False: learning_rate throughout, no warmup and no schedule
lr_schedule = "cosine"  # 'cosine', 'linear', 'polynomial' (peak to min_lr at lr_decay_iters), 'constant',
# 'wsd', or 'cosine_restarts' (cosine to min_lr and back to the peak every lr_cycle_iters, until lr_decay_iters)
warmup_iters = 100
warmup_ratio = 0.0  # if above 0: warm up over this fraction of the run's steps instead of warmup_iters
lr_decay_iters = 5000  # should be ~max_iters
lr_decay_fraction = 0.2  # wsd: stable at the peak, then a linear decay over this last part of lr_decay_iters
min_lr = 6e-5  # ~learning_rate/10
lr_cycle_iters = 1000  # cosine_restarts: steps from one restart to the next
lr_power = 1.0  # polynomial: the decay's power (1: linear)
# system
backend = "auto"  # DDP backend: 'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'
dist_timeout = 600  # seconds joining the process group, or a collective, may wait for the others before failing
# (so that torchrun can restart a group that lost a process, README: "Surviving failures")
device = "auto"  # 'auto' (cuda, then mps, then cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = "auto"  # 'float32', 'bfloat16', 'float16' (with a gradient scaler); auto: bf16 where supported on CUDA
compile = False  # torch.compile the model (slow first step, faster after)
seed = 1337  # sets the initial weights, the data order and dropout
# past one device's memory (README: "Scaling up"): shard, split, recompute, offload
fsdp = False  # FSDP2: shard weights, gradients and optimizer state over the data-parallel processes
fsdp_cpu_offload = False  # with fsdp: weights, gradients and optimizer state wait in CPU memory (CUDA only)
tp_size = 1  # tensor parallel over this many processes of a node: attention by heads, the MLP by its width
gradient_checkpointing = False  # keep only each block's input; recompute the rest in the backward pass
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))]
config = {k: globals()[k] for k in config_keys}
configure(config, sys.argv[1:])
globals().update(config)


def fail(msg):
    sys.exit(f"train.py: {msg}")


for k in ("eval_interval", "log_interval", "eval_iters", "batch_size", "block_size", "gradient_accumulation_steps",
          "max_skipped_steps", "dist_timeout"):
    if globals()[k] < 1:
        fail(f"{k}={globals()[k]} must be at least 1")
if use_kernels not in (None, True, False):
    fail(f"use_kernels={use_kernels!r} must be True, False or None (auto)")
if optimizer not in ("adamw", "muon", "adam", "sgd"):
    fail(f"optimizer={optimizer!r} is not one of 'adamw', 'muon', 'adam', 'sgd'")
if tensorboard_log:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        fail("tensorboard_log=True needs TensorBoard: pip install tensorboard")
SCHEDULES = ("cosine", "linear", "polynomial", "constant", "wsd", "cosine_restarts")
if lr_schedule not in SCHEDULES:
    fail(f"lr_schedule={lr_schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
if lr_cycle_iters < 1 or lr_power <= 0:
    fail(f"lr_cycle_iters={lr_cycle_iters} must be at least 1 and lr_power={lr_power} above 0")
if eval_full and not 0 <= eval_stride < block_size:
    fail(f"eval_stride={eval_stride} must be at least 0 and below block_size={block_size} (the windows' overlap)")
if sequences not in ("windows", "examples"):
    fail(f"sequences={sequences!r} is not 'windows' or 'examples'")
if max_epochs < 0 or not 0 <= warmup_ratio < 1:
    fail(f"max_epochs={max_epochs} must be at least 0 and warmup_ratio={warmup_ratio} in [0, 1)")
if not 0 <= lr_decay_fraction <= 1:
    fail(f"lr_decay_fraction={lr_decay_fraction} must be between 0 and 1")

# -----------------------------------------------------------------------------
# 2. devices and processes

ddp = "RANK" in os.environ  # started by torchrun
rank = int(os.environ.get("RANK", 0))
local_rank = int(os.environ.get("LOCAL_RANK", 0))
world_size = int(os.environ.get("WORLD_SIZE", 1))
master = rank == 0  # the process that logs and writes checkpoints
try:
    device, dtype = pick_device(device, dtype)
except ValueError as e:
    fail(str(e))
# Under torchrun, 'cuda' and 'cuda:N' both mean each process's own GPU, the one of its local rank: one index
# for every process would put them all on one GPU.
if device.startswith("cuda") and ddp:
    device = f"cuda:{local_rank}"
device_type = device.split(":")[0]
if device_type == "cuda":
    torch.cuda.set_device(device)
# Tensor parallel shards the rest of each replica with FSDP too (over a mesh of one replica, if so): every
# parameter is then a DTensor on the one mesh, which the fused optimizer step and the clipping need
try:
    check_layout(tp_size, fsdp, fsdp_cpu_offload, device_type, dtype, optimizer)
except ValueError as e:
    fail(str(e))
fsdp = fsdp or tp_size > 1
if backend == "auto":  # offloaded shards' gradient norms are reduced on the CPU: gloo beside nccl
    backend = "gloo" if device_type != "cuda" else "cuda:nccl,cpu:gloo" if fsdp_cpu_offload else "nccl"
if ddp:
    # torchrun's store outlives a restart of its workers, and so would the addresses the last group wrote there:
    # each restart of the group keeps its keys apart, or the new workers would dial their dead peers. Joining
    # waits dist_timeout at most, so a group that cannot form fails, and torchrun tries again.
    store = next(dist.rendezvous("env://", timeout=timedelta(seconds=dist_timeout)))[0]
    store = dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=dist_timeout))
elif fsdp:  # one process: FSDP still needs a process group (of one), e.g. to offload a model past a GPU
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
# Processes form a (data parallel, tensor parallel) grid: the tp_size processes of one model replica are
# neighbours (one node), they share their batches, and the replicas split the data between them
if tp_size < 1 or world_size % tp_size:
    fail(f"tp_size={tp_size} must divide the {world_size} processes (torchrun --nproc_per_node=N, N a multiple)")
dp_size = world_size // tp_size
mesh = None
if dist.is_initialized():
    mesh = init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
if gradient_accumulation_steps % dp_size:
    fail(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
         f"{dp_size} data-parallel replicas (it counts micro-steps over all of them)")
micro_steps = gradient_accumulation_steps // dp_size  # this replica's share
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
ptdtype = getattr(torch, dtype)
autocast = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=ptdtype)
if device_type == "cuda":
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32 for the float32 matmuls that remain
    torch.backends.cudnn.allow_tf32 = True
# One run writes an out_dir at a time (lock.py): the master holds its lock until it exits, and a second run into
# it stops here, every process with the master's one line, before it reads or writes anything there.
refused = None
if master:
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        fail(f"cannot make out_dir={out_dir} ({e.strerror}): choose a folder this user can write to")
    try:
        atexit.register(unlock_folder, out_dir, lock_folder(out_dir, "train.py"))
    except ValueError as e:
        refused = str(e)
if ddp:
    said = [refused]
    dist.broadcast_object_list(said, src=0)
    refused = said[0]
if refused:
    fail(refused)
if master:
    print(f"{world_size} process(es) on {device_type}, {dtype}; tokens per update: {tokens_per_iter:,} "
          f"({gradient_accumulation_steps} micro-steps x {batch_size} sequences x {block_size} tokens)")

# -----------------------------------------------------------------------------
# 3. data: token files are memory-mapped, never read whole. The sequences of a step are a pure function
# of (seed, step): a resumed run sees exactly the batches it would have seen, and the same tokens
# per update give the same sequences however they are split into processes and micro-steps

meta_path = os.path.join(data_dir, "meta.json")  # or nanoGPT's meta.pkl, or GPT-2 tokens with neither
try:
    meta = read_meta(data_dir)
except ValueError as e:
    fail(str(e))
eot_id = meta.get("eot_id")  # end-of-text: where one document ends and the next begins
if (doc_mask or sequences == "examples") and eot_id is None:
    fail(f"{'doc_mask=True' if doc_mask else 'sequences=examples'} needs the end-of-text id, and {meta_path} "
         f"gives none (prepare the data with prepare.py, or set doc_mask=False and sequences='windows')")
if vocab_size == 0:
    vocab_size = 64 * math.ceil(meta["vocab_size"] / 64)
if meta["vocab_size"] > vocab_size:
    fail(f"{meta_path} says the data has {meta['vocab_size']} token ids but the model's vocab_size is "
         f"{vocab_size} (set vocab_size=0 to follow the data)")
try:  # whole examples need no minimum length; windows need one longer than block_size
    train_tokens = check_token_files(data_dir, meta, block_size if sequences == "windows" else 0)
    for split in ("train", "val"):  # and every id in them is one meta.json's vocabulary has
        check_token_ids(os.path.join(data_dir, f"{split}.bin"), meta["dtype"], meta["vocab_size"])
except ValueError as e:
    fail(str(e))

# -----------------------------------------------------------------------------
# 4. where the run begins: from scratch, from a Hugging Face folder, or from its own checkpoint

model_args = dict(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, n_embd=n_embd, block_size=block_size,
                  vocab_size=vocab_size, dropout=dropout, tie_embeddings=tie_embeddings,
                  use_kernels=use_kernels)
try:
    check_sizes(model_args, "this run", "set it to a whole number above 0")
except ValueError as e:
    fail(str(e))
ckpt_path = os.path.join(out_dir, "ckpt.pt")
iter_num, best_val_loss, evals_without_gain, skipped_in_a_row = 0, float("inf"), 0, 0
evaluated_at = None  # the step whose evaluation is done (a checkpoint saved on a signal may lack it)
try:  # ckpt.pt, or the sharded folder ckpt/ of a run begun under FSDP or tensor parallel (find_checkpoint)
    found_ckpt = ckpt.find_checkpoint(ckpt_path)
except ValueError as e:
    fail(str(e))
if ddp:  # every process must see the same checkpoint, or they would start from different states
    seen = torch.tensor([float(found_ckpt is not None)], device=device)
    dist.all_reduce(seen)
    if 0 < seen.item() < world_size:
        fail(f"{ckpt_path} is visible to {seen.item():.0f} of {world_size} processes: out_dir must be on storage "
             f"every node shares")
try:  # the checkpoint's weights and optimizer state are read once the model is laid out
    init_from, checkpoint = ckpt.starting_point(out_dir, init_from, found_ckpt)
    if checkpoint is not None:
        ckpt.check_resume(checkpoint, config, meta["vocab_size"], found_ckpt)
except ValueError as e:
    fail(str(e))
from_folder = init_from not in ("scratch", "resume")  # a Hugging Face model folder to fine-tune
# an out_dir keeps the layout it began with: sharded folders (FSDP, tensor parallel) or files
sharded = os.path.isdir(found_ckpt) if found_ckpt else fsdp
pretrained = os.path.abspath(init_from) if from_folder else None  # where the weights began, kept on resume
if init_from != "resume" and master and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
    os.remove(os.path.join(out_dir, "metrics.jsonl"))  # left by a run that died before its first checkpoint
if checkpoint is not None:
    pretrained = checkpoint.get("pretrained")
    # the weights decide the shape; dropout, the kernels and (from scratch) block_size are this run's
    model_args = {**checkpoint["model_args"], "dropout": dropout, "use_kernels": use_kernels}
    if not pretrained:  # a pretrained model's block_size is its own limit, not the length trained on
        model_args["block_size"] = block_size
    iter_num, best_val_loss = checkpoint["iter_num"], checkpoint["best_val_loss"]
    evals_without_gain, skipped_in_a_row = checkpoint["evals_without_gain"], checkpoint["skipped_in_a_row"]
    evaluated_at = iter_num if checkpoint["evaluated"] else None
    if 0 < early_stop_patience <= evals_without_gain:
        if master:
            print(f"this run stopped early at step {iter_num} (no better val loss in {evals_without_gain} "
                  f"evaluations): nothing to do; raise early_stop_patience to train on")
        sys.exit(0)
    # the batches of a step depend on these alone, not on how many processes share them
    shaping = ("seed", "batch_size", "gradient_accumulation_steps", "sequences")
    if any(checkpoint["config"].get(k) != globals()[k] for k in shaping) and master:
        print(f"warning: {', '.join(shaping)} changed since the checkpoint: training continues, "
              "but not on the batches the first run would have seen")
    before = {k: checkpoint["config"].get(k) for k in ("max_iters", "lr_decay_iters")}
    if before["max_iters"] != max_iters and master:  # the run's end moves, and with lr_decay_iters its schedule
        was = f" (was {before['lr_decay_iters']})" if before["lr_decay_iters"] != lr_decay_iters else ""
        print(f"note: max_iters is {max_iters}, not the checkpoint's {before['max_iters']}: the run ends at step "
              f"{max_iters}; lr_decay_iters, the schedule's length, is {lr_decay_iters}{was}")

# LoRA: this command's rank on a fresh start from a folder, the checkpoint's on a resume
lora = lora_rank if from_folder else model_args.get("lora_rank", 0) if checkpoint is not None else 0
if lora and checkpoint is not None:  # a resumed run's base is held as it was (4 bits stay 4 bits)
    lora_base_dtype = checkpoint["config"].get("lora_base_dtype", lora_base_dtype)
try:
    check_lora(lora_rank, lora, lora_base_dtype, tp_size, fsdp)
except ValueError as e:
    fail(str(e))
if from_folder:
    try:  # data for a pretrained model must be made with its own tokenizer, or its ids mean other words
        model_vocab = int(read_json(os.path.join(init_from, "config.json"))["vocab_size"])
        check_tokenizer(data_dir, meta, init_from, model_vocab)
    except (ValueError, KeyError, TypeError) as e:
        fail(str(e) if isinstance(e, ValueError) else f"cannot read the vocab_size in {init_from}/config.json "
             f"({type(e).__name__}: {e})")

# -----------------------------------------------------------------------------
# 5. the model, laid out over the processes, and its optimizers

# Full fine-tuning keeps fp32 master weights whatever the folder holds (autocast computes in dtype); a
# frozen LoRA base needs only the dtype it computes in, and nf4 or int8 is quantized from that.
base_dtype = dtype if lora_base_dtype in ("auto", "nf4", "int8") else lora_base_dtype
base_dtype = getattr(torch, base_dtype) if lora else torch.float32
torch.manual_seed(seed)  # the same initial weights in every process
base_fingerprint = checkpoint.get("base_fingerprint") if checkpoint is not None else None
try:
    if checkpoint is not None and (lora or not os.path.isdir(found_ckpt)):  # a sharded one's weights: below
        run_settings = {k: model_args[k] for k in ("dropout", "use_kernels", "block_size")}
        model = ckpt.model_from_checkpoint(checkpoint, base_dtype, **run_settings)
    elif from_folder:
        base_fingerprint = fingerprint(init_from)
        model = load_pretrained(init_from, base_dtype, block_size, dropout=dropout, use_kernels=use_kernels)
        if lora:
            add_lora(model, lora_rank, lora_alpha, lora_dropout, lora_targets)
        model_args = asdict(model.config)
    else:
        model = GPT(GPTConfig(**model_args))
except (ValueError, OSError) as e:  # a shape that cannot be built, a folder with what GPT lacks, another base
    fail(str(e))
vocab_size = model_args["vocab_size"]
if not fsdp:  # (under FSDP it goes to the device one unit at a time, as each is sharded)
    model.to(device)
if lora and lora_base_dtype in ("nf4", "int8"):
    try:
        quantize_base(model, lora_base_dtype)
    except ValueError as e:
        fail(str(e))
if model.config.n_head % tp_size or model.config.n_kv_head % tp_size:
    fail(f"tp_size={tp_size} must divide n_head={model.config.n_head} and n_kv_head={model.config.n_kv_head} "
         f"(attention is split by heads)")
# Past one device (README, "Scaling up"): tensor parallel, checkpointing, compile, then FSDP or DDP
raw_model = model
model = parallelize(model, mesh, tp_size, fsdp, gradient_checkpointing, compile, ptdtype, fsdp_cpu_offload,
                    ddp=ddp and dp_size > 1, device_ids=[local_rank] if device_type == "cuda" else None)
try:
    optimizers = raw_model.configure_optimizers(optimizer, learning_rate, weight_decay, (beta1, beta2),
                                                device_type, momentum, muon_lr, muon_momentum)
except ValueError as e:
    fail(str(e))
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
if checkpoint is not None:
    try:
        ckpt.restore(found_ckpt, checkpoint, raw_model, optimizers, fsdp, lora)
    except ValueError as e:
        fail(str(e))
    scaler.load_state_dict(checkpoint["scaler"])
peak_lrs = [learning_rate, muon_lr][:len(optimizers)]  # the schedule scales each optimizer's own peak
torch.manual_seed(seed + dp_rank)  # dropout differs between replicas (a replica's tp processes agree)
if checkpoint is not None and len(checkpoint["rng"]) == world_size:
    torch.set_rng_state(checkpoint["rng"][rank]["cpu"])
    if device_type == "cuda" and checkpoint["rng"][rank]["cuda"] is not None:
        torch.cuda.set_rng_state(checkpoint["rng"][rank]["cuda"])
checkpoint = None  # free it
peak = peak_flops(device, ptdtype)
if master:
    trained = sum(p.numel() for p in raw_model.parameters() if p.requires_grad)
    # the block_size trained at, and a pretrained model's own limit beside it where that is longer
    shown = {**model_args, "block_size": block_size}
    limit = f" (the model's limit: {model_args['block_size']})" if model_args["block_size"] != block_size else ""
    print(f"model: {raw_model.num_params() / 1e6:.2f}M parameters, {trained / 1e6:.2f}M of them trained, "
          f"{shown}{limit}")
# what each process should hold, by kind, printed before the first step; on CUDA the first log line shows
# the measured peak beside it
layout = dict(dp=dp_size, tp=tp_size, fsdp=fsdp, checkpointing=gradient_checkpointing, offload=fsdp_cpu_offload)
memory = memory_estimate(raw_model, batch_size, block_size, dtype, optimizer,
                         quantized=lora_base_dtype if lora_base_dtype in ("nf4", "int8") else None,
                         micro_steps=micro_steps, device=device_type, **layout)
if master:
    print(memory_table([(memory_layout(**layout), memory)]))
try:  # found out now, not at the first save, hours in
    room_warning = ckpt.check_room(out_dir, raw_model, optimizer, lora)
except ValueError as e:
    fail(str(e))
if room_warning and master:
    print(room_warning)

# -----------------------------------------------------------------------------
# 6. the sequences (data.py): random windows, or whole examples packed best-fit, every one once per epoch
# and attending only within itself. Sequence n of the run is the same however processes share the steps

examples = sequences == "examples"
# Conversations are evaluated as they are trained: eval_full on a masked dataset, as every evaluation of a run on
# whole examples, scores each val example on its own over its trained targets; on text, eval_full's windows
by_example = {"train": examples, "val": examples or bool(eval_full and meta.get("masks"))}
splits = {split: Split(data_dir, split, meta, block_size, seed, by_example[split], vocab_size)
          for split in ("train", "val")}
sequences_per_step = gradient_accumulation_steps * batch_size
weighted = examples or meta.get("masks", False)  # micro-batches hold different numbers of targets (the loop)
end_of_epochs = None  # sequences in max_epochs epochs; past them, a step's sequences are empty
if max_epochs > 0:  # the run ends after max_epochs epochs, or at max_iters if that comes first
    end_of_epochs = splits["train"].sequences_in(max_epochs) if examples else None
    epoch_steps = math.ceil(end_of_epochs / sequences_per_step if examples else
                            max_epochs * train_tokens / tokens_per_iter)
    max_iters, lr_decay_iters = min(max_iters, epoch_steps), min(lr_decay_iters, epoch_steps)
if warmup_ratio > 0:
    warmup_iters = math.ceil(warmup_ratio * max_iters)
for split in (each for each in splits.values() if each.examples):  # cut to block_size, some may keep nothing
    if split.targets[0] == 0:
        fail(f"no {'val' if split.is_val else 'train'} example keeps a trained token within its first block_size + "
             f"1 = {block_size + 1} tokens ({split.cut} of {len(split.lengths)} are longer): raise block_size")
if master:  # which val loss this run logs
    print("val loss: " + ("each val example on its own, over its trained targets" if by_example["val"] else
                          f"every token of val.bin once, in windows overlapping by {eval_stride}" if eval_full else
                          f"{eval_iters} batches of random windows"))
if examples and master:
    train = splits["train"]
    real = int(np.minimum(train.lengths, block_size + 1).sum())
    print(f"examples: {len(train.lengths):,} in training, packed into {train.sequences_in(1):,} sequences per "
          f"epoch, {real / (train.sequences_in(1) * (block_size + 1)):.1%} of their tokens real; {train.cut} "
          f"longer than block_size + 1 = {block_size + 1} tokens, cut to it, keeping "
          f"{train.targets[0] / max(train.targets[1], 1):.1%} of the trained tokens")
if max_epochs > 0 and master:
    print(f"max_epochs={max_epochs}: {max_iters} steps (lr_decay_iters {lr_decay_iters}, warmup {warmup_iters})")


def batch(split, step, index):
    # the index-th micro-batch of a step (evaluation's have step -1) -> x, y, doc_ids on the device; y is -1
    # where nothing is learned
    try:
        if split == "val" and (eval_full or examples):  # every target once: whole examples, or strided windows
            numbers = range(index * batch_size, (index + 1) * batch_size)
            tensors = splits[split].scored(numbers, eval_stride, doc_mask)
        elif examples:
            first = (max(step, 0) * gradient_accumulation_steps + index) * batch_size
            tensors = splits[split].packed(range(first, first + batch_size), end_of_epochs if step >= 0 else None)
        else:
            tensors = splits[split].windows(step, index, batch_size, doc_mask)
    except ValueError as e:
        fail(str(e))
    if device_type == "cuda":
        return [t if t is None else t.pin_memory().to(device, non_blocking=True) for t in tensors]
    return [t if t is None else t.to(device) for t in tensors]


# -----------------------------------------------------------------------------
# 7. what the loop calls: the learning rate, evaluation, checkpoints, logging


def lr_factor(it):
    # the fraction of its peak every learning rate has at step it: a linear warmup, then lr_schedule
    # from 1 down to floor (min_lr's fraction of learning_rate) at lr_decay_iters, the floor after it
    if not decay_lr:
        return 1.0
    if it < warmup_iters:
        return (it + 1) / (warmup_iters + 1)
    floor = min_lr / learning_rate if learning_rate > 0 else 0.0
    if lr_schedule == "constant":
        return 1.0
    if it >= lr_decay_iters:
        return floor
    if lr_schedule == "wsd":  # stable at the peak, then linear over the last lr_decay_fraction
        decay_start = max(warmup_iters, lr_decay_iters - lr_decay_fraction * lr_decay_iters)
        ratio = max(0.0, it - decay_start) / max(1, lr_decay_iters - decay_start)
        return 1.0 - ratio * (1.0 - floor)
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    if lr_schedule in ("linear", "polynomial"):
        return floor + (1.0 - ratio) ** (lr_power if lr_schedule == "polynomial" else 1) * (1.0 - floor)
    if lr_schedule == "cosine_restarts":  # where in its cycle the step is
        ratio = (it - warmup_iters) % lr_cycle_iters / lr_cycle_iters
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)  # cosine


@torch.no_grad()
def estimate_loss():
    # mean loss and next-token accuracy over every trained target of the same batches every time: eval_iters
    # batches of each split, or all of val (eval_full, or whole examples); over all processes. The raw model
    # computes them a chunk of logits at a time.
    model.eval()
    out = {}
    for split in ("train", "val"):
        batches = eval_iters
        if split == "val" and (eval_full or examples):  # all of it, as many batches in every process
            count = splits["val"].scored_count(eval_stride)
            batches = math.ceil(count / (batch_size * dp_size))
        sums = torch.zeros(3, device=device)  # loss and accuracy, each times its targets; the targets
        for k in range(batches):
            x, y, doc_ids = batch(split, -1, k * dp_size + dp_rank)
            with autocast:
                loss, accuracy = raw_model.loss_and_accuracy(x, y, doc_ids)
            targets = (y != -1).sum().float()
            sums += torch.stack([loss.float() * targets, accuracy.float() * targets, targets])
        if ddp:
            dist.all_reduce(sums)
        out[split], out[f"{split}_accuracy"] = (sums[:2] / sums[2].clamp(min=1)).tolist()
    model.train()
    return out


def rng_state():
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}


def save_checkpoint(improved, finished_epoch=None, rng=None):
    # rng: this process's random state at the step saved (a save held back to the next step passes its own)
    rng = rng or rng_state()
    rngs = [None] * world_size
    if ddp:
        dist.all_gather_object(rngs, rng)  # every process's dropout stream, for an exact resume
    else:
        rngs = [rng]
    state = {
        "scaler": scaler.state_dict(), "model_args": model_args, "iter_num": iter_num, "best_val_loss": best_val_loss,
        "evals_without_gain": evals_without_gain, "skipped_in_a_row": skipped_in_a_row,
        "evaluated": evaluated_at == iter_num, "config": config, "world_size": world_size, "rng": rngs,
        "data_dir": os.path.abspath(data_dir),  # for sample.py, from wherever it runs
        "pretrained": pretrained,  # the Hugging Face folder the run began from, if any
        "base_fingerprint": base_fingerprint,
    }
    try:
        ckpt.save(out_dir, state, raw_model, optimizers, sharded, lora, improved, keep_last_n, finished_epoch)
        failed = None
    except ValueError as e:  # a full disk, a folder gone: what the save began is removed, the last one is intact
        failed = str(e)
    if ddp:  # every process stops, or the others would wait for this one at the next step
        failures = torch.tensor([float(failed is not None)], device=device)
        dist.all_reduce(failures)
        if failures.item() and failed is None:
            failed = "another process could not write the checkpoint (its error is above)"
    if failed:
        fail(failed)


def log(record):
    # stdout is the caller's; here out_dir/metrics.jsonl, wandb and TensorBoard
    global metrics_failed
    if not master:
        return
    try:
        with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as e:  # a record lost is no reason to lose the run: said once
        if not metrics_failed:
            print(f"warning: cannot write {out_dir}/metrics.jsonl ({e.strerror}); training goes on without it")
        metrics_failed = True
    if wandb_log:
        wandb.log(record, step=record["iter"])
    if tensorboard:
        for key, value in record.items():  # the numbers: not the step itself, a None or the skipped flag
            if key != "iter" and isinstance(value, (int, float)) and not isinstance(value, bool):
                tensorboard.add_scalar(key, value, record["iter"])


def epoch():
    # passes over the training split so far: sequences (examples) or tokens (windows) over the split's
    if examples:  # (a last step partly past max_epochs holds padding, not the next epoch)
        return splits["train"].epoch_at(min(iter_num * sequences_per_step, end_of_epochs or math.inf))
    return iter_num * tokens_per_iter / train_tokens


config.update(device=device, dtype=dtype, backend=backend, vocab_size=vocab_size, init_from=init_from)  # resolved
if wandb_log and master:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
tensorboard = SummaryWriter(os.path.join(out_dir, "tb")) if tensorboard_log and master else None

# preemption: SIGTERM or SIGINT finishes the current step, saves, and exits 0
stop_requested, metrics_failed = False, False
# A checkpoint of an evaluated step is held back until the next update has computed its gradient at those
# weights: written then if the gradient is finite, dropped if not. So every checkpoint written along the way
# is of weights that still gave a finite gradient, and a run that diverges (learning_rate=1e9: one finite
# update, then nothing but NaN) stops with ckpt.pt from before the update that broke it.
held_back = None  # (improved, the random state at that step) of the checkpoint held back


def request_stop(signum, frame):
    global stop_requested
    if stop_requested and signum == signal.SIGINT:
        raise KeyboardInterrupt  # a second Ctrl-C: stop now
    stop_requested = True


signal.signal(signal.SIGTERM, request_stop)
signal.signal(signal.SIGINT, request_stop)

if eval_tasks and (fsdp or tp_size > 1):
    fail("eval_tasks runs on the master process alone, which holds the whole model only without fsdp and tp_size")
if eval_tasks and master:  # the tasks are checked, and their data loaded, before the first step (README: Evaluating)
    import harness
    try:
        task_model = harness.for_training(raw_model, data_dir, device, autocast, batch_size, eval_tasks,
                                          eval_tasks_path)
    except ValueError as e:
        fail(str(e))

# -----------------------------------------------------------------------------
# 8. the training loop

t_log, iters_since_log, keys_since_log, logged = time.time(), 0, 0.0, False
while True:
    # evaluate (and checkpoint) every eval_interval steps and at the end
    if (iter_num % eval_interval == 0 or iter_num == max_iters) and iter_num != evaluated_at:
        losses = estimate_loss()
        evaluated_at = iter_num
        task_scores = harness.task_metrics(*task_model, eval_tasks_limit) if eval_tasks and master else {}
        improved = losses["val"] < best_val_loss - early_stop_min_delta
        if improved:
            best_val_loss = losses["val"]
        evals_without_gain = 0 if improved else evals_without_gain + 1
        if master:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
                  f"val perplexity {math.exp(min(losses['val'], 50)):.2f}, "
                  f"val accuracy {losses['val_accuracy']:.1%}, epoch {epoch():.2f}")
            if task_scores:
                print(f"step {iter_num}: " + ", ".join(f"{name} {value:.4f}" for name, value in task_scores.items()))
        log({"iter": iter_num, "loss": losses["train"], "val_loss": losses["val"],
             "val_ppl": math.exp(min(losses["val"], 50)), "accuracy": losses["train_accuracy"],
             "val_accuracy": losses["val_accuracy"], "lr": learning_rate * lr_factor(iter_num),
             "epoch": epoch(), **task_scores})
        early_stop = early_stop_patience > 0 and evals_without_gain >= early_stop_patience
        if iter_num > 0 and (improved or always_save_checkpoint or iter_num == max_iters or early_stop):
            if iter_num >= max_iters or early_stop:
                save_checkpoint(improved)  # the run ends here: nothing comes after to vouch for this state
            else:  # saved in the next update, once its gradient is finite (see held_back)
                held_back = (improved, rng_state())
        if early_stop:
            if master:
                print(f"early stop: no better val loss in {early_stop_patience} evaluations")
            break
        t_log, iters_since_log, keys_since_log = time.time(), 0, 0.0  # evaluation time is not training time
    if iter_num >= max_iters:
        break

    # one update: micro-steps with gradient sync only on the last, then clip and step
    epoch_before = int(epoch()) if save_every_epoch else None
    factor = lr_factor(iter_num)
    for opt, peak_lr in zip(optimizers, peak_lrs):
        for group in opt.param_groups:
            group["lr"] = peak_lr * factor
    lr = learning_rate * factor
    loss_sum = torch.zeros((), device=device)
    keys_run = torch.zeros((), device=device, dtype=torch.long)  # keys the queries attend to: the FLOPs run
    batches = [batch("train", iter_num, dp_rank * micro_steps + micro) for micro in range(micro_steps)]
    # With masks or packed examples, micro-batches hold different numbers of targets: each one's mean loss is
    # weighted by its share of the targets of the whole update (over every process), so that the update's
    # loss is their mean, however they fall into micro-steps and processes.
    if weighted:
        targets = torch.stack([(y != -1).sum() for _, y, _ in batches]).float()
        all_targets = targets.sum()
        if ddp:  # the tensor-parallel processes of a replica hold the same batches: counted tp_size times
            dist.all_reduce(all_targets)
            all_targets /= tp_size
        shares = targets * dp_size / all_targets.clamp(min=1)  # stays on the device: no wait for it
    for micro, (x, y, doc_ids) in enumerate(batches):
        last = micro == micro_steps - 1
        if fsdp:  # gradients summed unsharded on each process, reduced and split once, after the last
            raw_model.set_requires_gradient_sync(last)
        # The documents' mask is made here, outside the model: FlexAttention's block mask (on CUDA; it has no
        # dropout) made inside a compiled model would recompile it for every batch.
        mask = None if doc_ids is None else document_mask(doc_ids, flex=device_type == "cuda" and dropout == 0)
        with (model.no_sync() if isinstance(model, DDP) and not last else nullcontext()), autocast:
            _, loss = model(x, y, mask=mask)
            loss = loss * shares[micro] if weighted else loss / micro_steps
        scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
        B, T = x.shape
        keys_run += attended_keys(doc_ids) if doc_ids is not None else B * T * (T + 1) // 2  # causal
    stop = torch.tensor([float(stop_requested)], device=device)
    if ddp:  # every process agrees on the mean loss and on whether to stop
        both = torch.cat([loss_sum.view(1), stop])
        dist.all_reduce(both)
        loss_sum, stop = both[0] / world_size, both[1:]
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = clip_gradients(raw_model, grad_clip if grad_clip > 0 else float("inf"))
    # one copy to the host per step: on a GPU each .item() waits for all the work queued before it
    # (the norm of gradients offloaded to the CPU is on the CPU)
    grad_norm = grad_norm.view(1).float().to(device)
    step_values = torch.cat([loss_sum.view(1), grad_norm, stop, keys_run.view(1).float()]).tolist()
    loss_value, grad_norm_value, stop_value, keys_value = step_values
    if math.isfinite(loss_value) and math.isfinite(grad_norm_value):
        if held_back:  # the weights are still the evaluated step's, and its gradient is finite: a good state
            improved_then, rng_then = held_back
            saving = time.time()
            save_checkpoint(improved_then, rng=rng_then)
            t_log += time.time() - saving  # saving time is not training time either
        held_back = None
        for opt in optimizers:
            scaler.step(opt)
        skipped_in_a_row = 0
    else:  # a non-finite loss or gradient: apply nothing, not even to the optimizer's moments
        held_back = None  # and keep no checkpoint of weights that gave it: ckpt.pt stays the last good state
        skipped_in_a_row += 1
        if master:
            print(f"iter {iter_num + 1}: skipped, loss {loss_value}, grad norm {grad_norm_value} "
                  f"({skipped_in_a_row} in a row)")
        log({"iter": iter_num + 1, "loss": loss_value, "grad_norm": grad_norm_value, "skipped": True})
    scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if skipped_in_a_row >= max_skipped_steps:
        good = ckpt.find_checkpoint(os.path.join(out_dir, "ckpt.pt"))
        good = f"{good}, from step {ckpt.load_checkpoint(good, mmap=True, weights=False)['iter_num']}, is the " \
               f"last good state" if good else "no checkpoint was saved before it"
        fail(f"{skipped_in_a_row} updates in a row had a non-finite loss or gradient; stopped, and {good} "
             f"(lower learning_rate, or check the data)")
    iter_num += 1
    iters_since_log += 1
    keys_since_log += keys_value

    if iter_num % log_interval == 0 and master and skipped_in_a_row == 0:
        dt = (time.time() - t_log) / iters_since_log
        tokens_per_s = tokens_per_iter / dt
        # the first line on CUDA puts the measured peak beside the estimate printed at the start
        first_on_cuda = device_type == "cuda" and not logged
        memory_note = f" (estimate {memory['device'] / 2**20:,.0f} MB)" if first_on_cuda else ""
        logged = True
        # MFU in PaLM's convention (every query against all T keys, as nanoGPT and nanochat report it), and of
        # the FLOPs run: attention as masked, causal and within documents (this process's keys per token)
        keys = keys_since_log / (iters_since_log * micro_steps * batch_size * block_size)
        flops = [raw_model.flops_per_token(block_size, k) * tokens_per_s / world_size for k in (None, keys)]
        mfu, mfu_run = (f / peak if peak else None for f in flops)  # None: the peak is unknown
        mfu_note = f"{mfu:.1%} PaLM, {mfu_run:.1%} run" if mfu else "n/a"
        print(f"iter {iter_num}: loss {loss_value:.4f}, lr {lr:.2e}, grad norm {grad_norm_value:.3f}, "
              f"epoch {epoch():.2f}, {dt * 1000:.0f} ms/iter, {tokens_per_s:,.0f} tok/s, MFU {mfu_note}, "
              f"mem {measured_mb(device):,.0f} MB{memory_note}")
        log({"iter": iter_num, "loss": loss_value, "lr": lr, "grad_norm": grad_norm_value, "ms_per_iter": dt * 1000,
             "tokens_per_s": tokens_per_s, "mfu": mfu, "mfu_run": mfu_run, "mem_mb": measured_mb(device),
             "epoch": epoch()})
        t_log, iters_since_log, keys_since_log = time.time(), 0, 0.0
    if save_every_epoch and int(epoch()) > epoch_before:  # this step finished an epoch: kept as ckpt_epoch_N
        save_checkpoint(False, int(epoch()))
    if stop_value > 0:  # every process sees the same flag, so all stop after the same step
        print(f"process {rank}: stop requested, saving at step {iter_num} and exiting", flush=True)
        save_checkpoint(False)
        break

if tensorboard:
    tensorboard.close()  # write out what is buffered
if dist.is_initialized():
    # free DDP's reducer (it holds gloo's pending work) now: freed at interpreter exit instead, it
    # sometimes aborted a process ("terminate called without an active exception"), 1 run in ~12 here
    del model
    gc.collect()
    dist.barrier()  # let the master finish writing before any process tears the group down
    dist.destroy_process_group()
