"""
Devices and processes (model.py knows none of it): the run's device, peak FLOP/s and (dp, tp) process mesh; parallelize,
spreading a model over it as torchtitan does (names kept: checkpoints move between layouts); cross-process loop steps.

    model = parallelize(model, mesh, tp=2, fsdp=True, checkpointing=True, compile=True, dtype=torch.bfloat16)
"""

import gc
import os
import re
import signal
import socket
import sys
import time
from datetime import timedelta
from functools import partial
from typing import NamedTuple

import torch
import torch.distributed as dist

from lib.files import UserError
from model import PROJECTIONS, attention

# tensor parallel splits by output (whole heads, hidden units each), their consumers by input; one all-reduce a pair
SPLIT_BY_OUTPUT, SPLIT_BY_INPUT = ("q", "k", "v", "gate", "up"), ("o", "down")
# weights inside attention or the MLP, beside the projections, that tensor parallel leaves whole and each process
# applies to its own heads: their gradients are summed over the processes (sum_head_gradients)
HEAD_WEIGHTS = ("q_norm.weight", "k_norm.weight")


def is_dtensor(t):
    # a shard of FSDP or tensor parallel: none where torch.distributed.tensor (~1.3 s to import) never was
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def pick_device(device="auto", dtype="auto"):
    """Resolve the 'auto' settings: cuda, then mps, then cpu; bf16 where the GPU has it, else float32.
    Returns (device, dtype name); a CUDA device without a GPU or an unknown dtype is a one-line UserError."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):
        raise UserError(f"device={device!r} is not one of 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'")
    if device == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but no Apple GPU is visible (use --device=cpu)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={device} but no CUDA GPU is visible (use --device=cpu)")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") and torch.cuda.is_bf16_supported() else "float32"
    from lib.settings import DTYPES  # (settings' optim imports this module)
    if dtype not in DTYPES:
        raise UserError(f"dtype={dtype!r} is not one of 'auto', {', '.join(map(repr, DTYPES))}")
    return device, dtype


# datasheet dense matmul peaks, FLOP/s: (bf16/fp16 on tensor cores, tf32); a name's first key wins: variants first
GPU_PEAKS = {"H100 NVL": (835e12, 418e12), "H100 PCIe": (756e12, 378e12), "H100 SXM": (989e12, 494e12),
             "H200 NVL": (835e12, 418e12), "H200": (989e12, 494e12), "B200": (2250e12, 1100e12),
             "A100": (312e12, 156e12), "L40S": (362e12, 183e12), "A10G": (70e12, 35e12), "4090": (165e12, 83e12),
             "3090": (71e12, 36e12)}


def gpu_peak(name, sm_count, half):
    """The dense peak FLOP/s of a GPU by its name and SM count, in half precision (half) or tf32; None if not in
    GPU_PEAKS. An H100 but the NVL is named "NVIDIA H100" alone: the PCIe card has 114 SMs where the SXM has 132."""
    if "H100" in name and not any(form in name for form in ("NVL", "PCIe", "SXM")):
        name = name.replace("H100", "H100 PCIe" if sm_count == 114 else "H100 SXM")
    for key, (half_peak, tf32) in GPU_PEAKS.items():
        if key in name:
            return half_peak if half else tf32
    return None


def peak_flops(device, dtype):
    # dense matmul peak of one device in FLOP/s, for MFU; None where unknown
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return gpu_peak(props.name, props.multi_processor_count, dtype in (torch.bfloat16, torch.float16))
    if device.type == "cpu":
        # threads x clock x fp32 FLOPs a cycle of two FMA pipes (64 with AVX-512, 32 with AVX2): a nominal figure
        try:
            with open("/proc/cpuinfo") as f:
                info = f.read()
            mhz = float(info.split("cpu MHz")[1].split(":")[1].split()[0])
        except (OSError, IndexError, ValueError):
            return None
        per_cycle = 64 if " avx512f" in info else 32 if " fma" in info else 8
        return torch.get_num_threads() * mhz * 1e6 * per_cycle
    return None


class Processes(NamedTuple):
    """This process among the run's, as init_distributed found them; train.py names each value at the call."""
    ddp: bool  # started by torchrun
    rank: int
    local_rank: int
    world_size: int
    master: bool  # rank 0: it prints, logs and writes what one process writes
    device: str  # 'auto' resolved; under torchrun each process's own GPU
    device_type: str  # 'cuda', 'cpu', ...
    dtype: str  # 'auto' resolved
    backend: str  # 'auto' resolved
    fsdp: bool  # tensor parallel brings it
    mesh: object  # the (dp, tp) DeviceMesh, None without a process group
    dp_size: int  # data-parallel replicas
    dp_rank: int  # this process's replica


def generation(store, rank, world_size, timeout):
    """This group of workers' number in torchrun's store (TORCHELASTIC_RESTART_COUNT is per node: a node stopped for
    another's failure counts none). Rank 0 opens a generation; each other rank claims its place in the newest it sees,
    joining once rank 0 confirms (a dead group's places are claimed, or never confirmed). Waits timeout s at most."""
    if rank == 0:
        number = store.add("generation", 1)
        claims = [f"generation_{number}/claim_{r}" for r in range(1, world_size)]
        try:
            store.wait(claims, timedelta(seconds=timeout))
        except RuntimeError:  # the store's timeout (DistStoreError): which ranks never came, in one line
            missing = [r for r, key in enumerate(claims, 1) if not store.check([key])]
            raise UserError(f"rank(s) {missing} did not join rank 0 within dist_timeout={timeout} s: their node "
                            f"is lost or its torchrun stopped (see its output)") from None
        confirms = [f"generation_{number}/confirm_{r}" for r in range(1, world_size)]
        if confirms:
            store.multi_set(confirms, ["1"] * len(confirms))
        return number
    number, claimed, deadline = 0, False, time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = store.add("generation", 0)  # read as it is now (0: no rank 0 has opened one yet)
        if newest > number:  # claim this rank's place there, unless a dead group's process took it
            number = newest
            claimed = store.add(f"generation_{number}/claim_{rank}", 1) == 1
        if claimed and store.check([f"generation_{number}/confirm_{rank}"]):
            return number
        time.sleep(0.05)
    raise UserError(f"rank {rank} found no rank 0 to join within dist_timeout={timeout} s: rank 0's node is lost "
                    f"or its torchrun stopped (see its output)")


def this_process():
    # this process as a one-line refusal names it: its rank, its node (torchrun's GROUP_RANK) and host
    return f"rank {dist.get_rank()} (node {os.environ.get('GROUP_RANK', '?')}, host {socket.gethostname()})"


def stop_together(error):
    """Every process calls it, with the line of the UserError it met (else None): each raises the first process's
    where any met one, so that none waits in a collective for a process that stopped (on what it alone read)."""
    said = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [None] * dist.get_world_size()
        dist.all_gather_object(said, error)
    if found := next((line for line in said if line), None):
        raise UserError(found)


def check_same_settings(settings, data_dir):
    """Every process calls it: all stop, in one line naming the first difference and its rank and node, where any
    process's settings (per_node's paths aside) or data files' sizes differ from rank 0's (the replicas would drift)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return
    # paths: each node mounts the same files (sizes compared); and what the master alone reads (a config's
    # wandb_run_name = 'ft-' + str(time.time()), as in nanoGPT's, differs from process to process)
    per_node = ("out_dir", "data_dir", "eval_tasks_path", "wandb_run_name", "wandb_project")
    try:
        # the token files (and masks) that training reads, in bytes; meta.json may name where each node read from
        files = {f"the size of {name}": os.path.getsize(os.path.join(data_dir, name))
                 for name in sorted(os.listdir(data_dir)) if name.endswith(".bin")}
    except OSError:  # no data_dir here: its files differ, and read_meta would say so to this node alone
        files = {}
    mine = {**{k: v for k, v in settings.items() if k not in per_node}, **files}
    first = [mine]
    dist.broadcast_object_list(first, src=0)
    differs = next((k for k in {**first[0], **mine} if first[0].get(k, "missing") != mine.get(k, "missing")), None)
    said = [None] * dist.get_world_size()
    dist.all_gather_object(said, differs and f"{differs} is {mine.get(differs, 'missing')!r} on {this_process()} but "
                                             f"{first[0].get(differs, 'missing')!r} on rank 0")
    found = next((line for line in said if line), None)
    if found:
        raise UserError(f"the processes were started with different settings: {found} (give every node the "
                        f"same command, config files and data)")


def init_distributed(device, dtype, backend, tp_size, fsdp, offload, timeout):
    """This run's processes (torchrun's, or one alone) in a (dp, tp) mesh: 'auto' resolved, group joined."""
    said = [name for name in ("RANK", "WORLD_SIZE") if name in os.environ]  # torchrun sets both, a stray one is left
    if len(said) == 1 and os.environ.get("WORLD_SIZE") != "1":  # over from a job script (one process that took
        # WORLD_SIZE=2 ran half of what it printed; WORLD_SIZE=1 is one process)
        raise UserError(f"{said[0]} is set but {({'RANK', 'WORLD_SIZE'} - set(said)).pop()} is not: start the run with "
                        f"torchrun, or unset {said[0]}")
    ddp, rank, world_size = "RANK" in os.environ, int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, dtype = pick_device(device, dtype)
    device_type = device.split(":")[0]
    if device_type == "cuda":
        if ddp:  # 'cuda' and 'cuda:N' mean each process's own GPU (its local rank's)
            device = f"cuda:{local_rank}"
        if ":" in device:  # 'cuda' alone is the current GPU already, and set_device wants an index
            torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # float32 matmuls in TF32
    if (fsdp or tp_size > 1) and dtype == "float16":
        sharding = "fsdp=True" if fsdp else f"tp_size={tp_size} (which brings FSDP)"
        raise UserError(f"{sharding} does not work with dtype='float16' (its gradient scaler does not know sharded "
                        f"gradients): use dtype='bfloat16' or 'float32'")
    # tp > 1 brings FSDP (even of one replica): every parameter a DTensor on one mesh, for the fused step and clipping
    fsdp = fsdp or tp_size > 1
    if offload and not (fsdp and device_type == "cuda"):
        raise UserError("fsdp_cpu_offload=True moves FSDP's shards between a GPU and CPU memory: it needs fsdp=True "
                         "and a CUDA device")
    if backend == "auto":  # offloaded shards' gradient norms are reduced on the CPU: gloo beside nccl
        backend = "gloo" if device_type != "cuda" else "cuda:nccl,cpu:gloo" if offload else "nccl"
    if offload and backend.lower() != "gloo" and "cpu:" not in backend.lower():  # (nccl's take GPU tensors alone)
        raise UserError(f"backend={backend!r} has none for the CPU, where fsdp_cpu_offload=True keeps the shards and "
                        f"their gradients: use backend='auto' (cuda:nccl,cpu:gloo)")
    # a name torch has no backend for, wherever it runs (one process never uses it); one it lacks, where a group is made
    lacking = [b for b in backend.split(",") if b.split(":")[-1].lower() not in dist.Backend.backend_list
               or (ddp or fsdp) and not dist.is_backend_available(b.split(":")[-1])]
    if lacking:  # (else a traceback from init_process_group)
        have = [b for b in dist.Backend.backend_list if b not in ("undefined", "fake") and dist.is_backend_available(b)]
        raise UserError(f"backend={backend!r}: {lacking[0]!r} is no backend this torch has ({', '.join(have)}); use "
                        f"backend='auto'")
    if ddp:
        # torchrun's store outlives restarts: keys go under each group's generation, or new workers dial dead peers
        store = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout)))[0]
        store = dist.PrefixStore(f"generation_{generation(store, rank, world_size, timeout)}", store)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
    elif fsdp:  # one process: FSDP still needs a process group (of one), e.g. to offload a model past a GPU
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    if tp_size < 1 or world_size % tp_size:  # a replica: tp_size neighbours (one node) sharing its batches
        raise UserError(f"tp_size={tp_size} must divide the {world_size} processes (torchrun --nproc_per_node=N, "
                        f"N a multiple)")
    dp_size = world_size // tp_size
    mesh = None
    if dist.is_initialized():  # imported here: torch.distributed's layouts cost ~1.3 s, which one process never needs
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
        if tp_size > 1:  # what is partial over both dims (the gradients' norm) then takes one all-reduce, not two
            mesh["dp", "tp"]._flatten("dp_tp")
    return Processes(ddp=ddp, rank=rank, local_rank=local_rank, world_size=world_size, master=rank == 0,
                     device=device, device_type=device_type, dtype=dtype, backend=backend, fsdp=fsdp, mesh=mesh,
                     dp_size=dp_size, dp_rank=mesh["dp"].get_local_rank() if mesh is not None else 0)


def attention_in_stream(stream, q, k, v, mask, dropout, causal):
    # model.attention with its dropout drawn from a seed taken from the shared random stream plus stream (the process's
    # place in its replica): every process draws its own heads' masks, the shared stream advances alike in each (their
    # other dropout stays in step), and activation checkpointing replays it
    seed = int(torch.randint(2**62, ()))
    with torch.random.fork_rng(devices=[q.device] if q.is_cuda else [], device_type=q.device.type):
        torch.manual_seed(seed + stream)
        return attention(q, k, v, mask, dropout, causal)


def check_splittable(model, tp):
    """UserError for a parameter of an edited model.py that FSDP or tensor parallel (over tp processes) cannot lay
    out: a 0-dim one (torch's own error is a traceback from inside fully_shard), or under tensor parallel one inside
    attention or the MLP beside the projections and HEAD_WEIGHTS (its gradient would be one process's part of it, or
    summed twice)."""
    scalar = next((name for name, p in model.named_parameters() if p.dim() == 0), None)
    if scalar:
        raise UserError(f"{scalar} is a 0-dim parameter, which FSDP and tensor parallel cannot shard: give it the "
                        f"shape (1,) in model.py")
    split = tuple(f"{PROJECTIONS[n]}.{kind}" for n in PROJECTIONS for kind in ("weight", "bias")) + HEAD_WEIGHTS
    unknown = [name for name, _ in model.named_parameters() if re.search(r"\.(attn|mlp)\.", name)
               and not name.endswith(split)] if tp > 1 else []
    if unknown:
        raise UserError(f"tensor parallel splits attention and the MLP by heads, and cannot tell whether "
                        f"{unknown[0]} acts on a process's own heads (then add its name to lib/parallel.py's "
                        f"HEAD_WEIGHTS, to sum its gradient) or on the whole stream (then it belongs in Block)")


def parallelize(model, mesh=None, tp=1, fsdp=False, checkpointing=False, compile=False, dtype=torch.float32,
                offload=False, ddp=False, device_ids=None, from_master=False):
    """Spread model over mesh (dims "dp" and "tp"), in place where it can be, and return the module to call:
    tensor parallel over tp processes, activation checkpointing, compile, then FSDP or DDP over the replicas.
    Under FSDP with dtype bf16 the shards stay fp32, gathered as bf16, and gradients are reduced in fp32. from_master:
    the weights are the master's alone (start.first_model), sent to every process (by DDP's constructor, or here)."""
    if model.config.n_head % tp or model.config.n_kv_head % tp:
        raise UserError(f"tp_size={tp} must divide n_head={model.config.n_head} and n_kv_head="
                        f"{model.config.n_kv_head} (attention is split by heads)")
    if model.config.mlp_hidden % tp:
        raise UserError(f"tp_size={tp} must divide mlp_hidden={model.config.mlp_hidden} (the MLP is split by width)")
    if fsdp or tp > 1:
        check_splittable(model, tp)
    sent = (model.state_dict() if dist.get_rank() == 0 else {}) if from_master and fsdp else None  # whole, unsplit
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        plan = {PROJECTIONS[n]: ColwiseParallel() for n in SPLIT_BY_OUTPUT}
        plan.update({PROJECTIONS[n]: RowwiseParallel() for n in SPLIT_BY_INPUT})
        # one mesh object for every block: the compiled blocks' graphs are guarded on the one their hooks hold, and
        # mesh["tp"] a block at a time gave the first block another (a graph of its own, in training and evaluation)
        tp_mesh = mesh["tp"]
        in_stream = torch.compiler.disable(partial(attention_in_stream, tp_mesh.get_local_rank()))
        for block in model.blocks:
            parallelize_module(block, tp_mesh, plan)
            block.attn.attend_in_stream = in_stream  # each process's heads their own dropout masks
    if checkpointing:  # keep each block's input only; recompute the rest when the gradient comes back
        from torch.utils.checkpoint import checkpoint
        for block in model.blocks:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
    if compile:  # in place (names kept): the whole model in one graph (loss fused: ~8% faster on CPU), else each block
        for module in model.blocks if fsdp or tp > 1 else [model]:
            module.compile()
    if fsdp:
        from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
                                            register_fsdp_forward_method)
        mixed = MixedPrecisionPolicy()
        if dtype == torch.bfloat16:  # inputs uncast: rotary tables stay fp32 as under DDP (bf16 rotations: a loss gap)
            mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        offload = CPUOffloadPolicy() if offload else OffloadPolicy()
        for module in [*model.blocks, model]:  # a unit per block, whole only as it computes; the root (the rest) last
            fully_shard(module, mesh=mesh["dp"], mp_policy=mixed, offload_policy=offload)
        register_fsdp_forward_method(model, "loss_and_accuracy")  # evaluation calls it instead of forward
        if sent is not None:  # each tensor from the master to every process, which keeps its shard
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
            set_model_state_dict(model, sent, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    elif ddp:
        from torch.nn.parallel import DistributedDataParallel
        # a quantized frozen base (torchao's nf4, int8: tensor subclasses) is every process's own reading of its
        # folder, never the master's (train.py's sending): DDP's first broadcast leaves it out (int8 has no view for it)
        own = [n for n, p in model.named_parameters() if not p.requires_grad and type(p) is not torch.nn.Parameter]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, own)
        return DistributedDataParallel(model, device_ids=device_ids)
    return model


def end_processes():
    """The process group's end, once the caller has dropped its DDP module: its reducer holds gloo's pending work,
    and freed at exit it aborted 1 run in ~12 here ("terminate called without an active exception")."""
    gc.collect()
    dist.barrier()  # let the master finish writing before any process tears the group down
    dist.destroy_process_group()


class StopRequest:
    """Preemption: after SIGTERM or SIGINT, requested is True, and the loop finishes its step, saves and exits 0
    (every process agreeing on it). A second Ctrl-C stops at once."""

    def __init__(self):
        # by: the signal's name, for the line that says the run stopped (a process the signal did not reach: another's)
        self.requested, self.by = False, "a signal to another process"
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.request)

    def request(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.by = True, signal.Signals(signum).name


def target_shares(micro_batches, dp_size, tp_size, ddp):
    """Each micro-batch's weight in its update's loss: its share of the update's targets on all processes, times the
    replicas, so the loss is the mean over targets however they fall. Stays on the device: nothing waits for it."""
    targets = torch.stack([(y != -1).sum() for _, y, _ in micro_batches]).float()
    all_targets = targets.sum()
    if ddp:  # the tensor-parallel processes of a replica hold the same batches: counted tp_size times
        dist.all_reduce(all_targets)
        all_targets /= tp_size
    return targets * dp_size / all_targets.clamp(min=1)


def sum_head_gradients(model, mesh):
    """Under tensor parallel, the gradients of the weights that act on every head alike (HEAD_WEIGHTS: a process
    applies them to its own heads), each process's over its own heads, summed over the replica's processes (mesh's
    "tp"), in one all-reduce: the gradient one process has over all heads, the same in every copy."""
    grads = [p.grad.to_local() if is_dtensor(p.grad) else p.grad for name, p in model.named_parameters()
             if name.endswith(HEAD_WEIGHTS) and p.grad is not None]
    if grads:
        summed = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(summed, group=mesh["tp"].get_group())
        for g, part in zip(grads, summed.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def check_replicas(model, step):
    """UserError in every process where DDP's replicas hold different trained weights at step (the frozen ones, a
    QLoRA base's 4 bits among them, never change): each applies the same averaged gradients, so they part only where
    an edit makes one replica's update its own (random numbers drawn after the gradients' all-reduce, from the
    replica's own dropout stream), and a checkpoint keeps the master's alone."""
    total = torch.stack([p.detach().sum(dtype=torch.float32) for p in model.parameters() if p.requires_grad]).sum()
    spread = torch.stack([total, -total])
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)  # the largest sum, and the smallest
    if spread.isfinite().all() and spread[0] != -spread[1]:  # (a NaN is check_finite's to say)
        raise UserError(f"the weights of the DDP replicas differ at step {step}: something in the update is not the "
                        f"same in every replica (random numbers drawn after the gradients' all-reduce: each replica "
                        f"has a dropout stream of its own); make it the same, or the checkpoint keeps one replica's")


def clip_gradients(model, max_norm):
    # all gradients' norm (DTensor shards: each mesh and layout's group reduced over it), then scaled down to max_norm
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    groups = {}
    for g in grads:
        groups.setdefault((g.device_mesh, g.placements) if is_dtensor(g) else None, []).append(g)
    norms = [torch.nn.utils.get_total_norm(group) for group in groups.values()]
    total = torch.nn.utils.get_total_norm([n.full_tensor() if is_dtensor(n) else n for n in norms])
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # as torch's clip_grad_norm_, on each process's shards
    torch._foreach_mul_([g.to_local() if is_dtensor(g) else g for g in grads], scale)
    return total
