"""
batch_size='auto': each process's micro-batch, the largest whose estimated peak (memory.py's) fits the device's
memory, tried on the device. Only a run that asks for it imports this module (train.py).
"""

import os

import torch
import torch.distributed as dist

from lib.files import UserError
from lib.memory import device_name, memory_estimate, proc_kib


def available_memory(device):
    """Bytes a training process on device may hold at most, counting what it holds now: on CUDA the free memory and
    this process's own; on an Apple chip its recommended maximum; on a CPU what the kernel could give it (under its
    cgroup's limit, shared with the run's other processes on the node: LOCAL_WORLD_SIZE), plus its resident memory."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
    if kind == "mps":
        return torch.mps.recommended_max_memory()
    resident, available = resident_bytes(), proc_kib("MemAvailable", "/proc/meminfo")
    shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    room = [torch.iinfo(torch.int64).max if available is None else available * 1024 // shared + resident]
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2, then v1
                         (v1 + "limit_in_bytes", v1 + "usage_in_bytes")):
        try:
            with open(limit) as a, open(usage) as b:
                room.append((int(a.read()) - int(b.read())) // shared + resident)
        except (OSError, ValueError):  # no such cgroup, or 'max': no limit
            pass
    return min(room)


def resident_bytes():
    # this process's resident memory now (0 where /proc is not there to say)
    return (proc_kib("VmRSS") or 0) * 1024


def fit_micro_batch(peak, sequences, replicas, budget, margin=0.1, held=0):
    """The largest micro-batch b dividing a replica's share of sequences whose peak(b), a process's estimated bytes
    (held: those it holds already), fits in budget less margin -> (b, peak(b)); UserError if one sequence does not."""
    share = sequences // replicas
    room = budget * (1 - margin)
    for b in sorted((d for d in range(1, share + 1) if share % d == 0), reverse=True):
        if peak(b) <= room:
            return b, peak(b)
    need = peak(1)
    if held >= room:  # nothing but a larger budget helps
        raise UserError(f"batch_size='auto': this process holds {held / 2**20:,.0f} MiB already (Python, torch, the "
                        f"data), and {room / 2**20:,.0f} MiB may be used ({1 - margin:.0%} of {budget / 2**20:,.0f} "
                        f"MiB): raise memory_budget, or leave it 0 for what the machine has")
    already = f" ({held / 2**30:.2f} GiB of it held already: Python, torch, the data)" if held else ""
    raise UserError(f"batch_size='auto': one sequence needs {need / 2**30:.2f} GiB{already} where {room / 2**30:.2f} "
                    f"GiB may be used ({1 - margin:.0%} of {budget / 2**30:.2f} GiB), {(need - room) / 2**30:.2f} GiB "
                    f"short; raise memory_budget if it is set, turn on gradient_checkpointing, lower block_size, "
                    f"spread the model over more processes (fsdp=True), or, fine-tuning a released model, train LoRA "
                    f"adapters (lora_rank, with lora_base_dtype='nf4' for a 4-bit base)")


def auto_micro_batch(model, sequences, block_size, memory_budget, layout, before, autocast, same_batches=True,
                     **estimate):
    """batch_size='auto': each process's micro-batch for updates of `sequences` sequences of block_size tokens over
    layout's dp replicas -> (micro-batch, lines saying how it was chosen and the update shared out). A resumed run
    keeps the one it began with (before: its checkpoint) on the same device, budget and processes; else the largest
    whose peak (memory_estimate's; on a CPU, plus what the process holds beside the weights) fits in memory_budget GiB
    (0: available_memory) less 10%, tried, and halved while out of memory (FSDP and TP rely on the estimate alone).
    same_batches: the resume's steps draw the batches its checkpoint's did (resume.resume), and a new split is noted."""
    if sequences % layout["dp"]:
        raise UserError(f"batch_size='auto': the {sequences} sequences of an update (batch_size x "
                        f"gradient_accumulation_steps) must be a multiple of the {layout['dp']} data-parallel replicas")
    device, share = estimate["device"], sequences // layout["dp"]
    where = device_name(device)
    config = before["config"] if before else {}
    kept = config.get("batch_size_auto") and config["batch_size"]
    shared = (f"micro-batch {{}} x {{}} accumulation x {layout['dp']} processes x {block_size} tokens = "
              f"{sequences * block_size:,} tokens per update")
    same = kept and share % kept == 0 and (before.get("memory_device"), config.get("memory_budget"),
                                           before["world_size"]) == (where, memory_budget, layout["dp"] * layout["tp"])
    if smallest(int(bool(same)), device):  # each process asks of its own GPU: kept by all, or chosen anew by all
        return kept, (f"batch_size='auto': micro-batch {kept}, the one the run began with on {where}\n"
                      + shared.format(kept, share // kept))
    budget = memory_budget * 2**30 if memory_budget > 0 else available_memory(device)
    estimate = {**estimate, "device": torch.device(device).type, **layout}  # layout: memory_estimate's arguments
    one = memory_estimate(model, 1, block_size, **estimate)  # what the process holds already is counted there once:
    counted = one["weights"] + (one["optimizer"] if before else 0)  # the weights, a resume's optimizer state
    besides = max(0, resident_bytes() - counted) if torch.device(device).type == "cpu" else 0

    def peak(b):
        return besides + memory_estimate(model, b, block_size, micro_steps=share // b, **estimate)["device"]
    try:
        b, need, refused = *fit_micro_batch(peak, sequences, layout["dp"], budget, held=besides), None
    except UserError as e:  # said after the others heard: alone, it would leave them waiting at smallest()
        b, need, refused = 0, 0, e
    b = smallest(b, device)  # every process takes the same micro-batch (their free memory may differ)
    if refused or b == 0:
        raise refused or UserError("batch_size='auto': another process cannot fit one sequence (its line says why)")
    note = (f"batch_size='auto': micro-batch {b} of {share} sequences a process, estimated peak {need / 2**30:.2f} "
            f"GiB of {budget / 2**30:.2f} GiB ({'memory_budget' if memory_budget > 0 else where})")
    if memory_budget > 0 and budget > (room := available_memory(device)):  # (a CPU's would meet the OOM killer)
        note += f", more than the {room / 2**30:.2f} GiB this process may have here ({where})"
    if kept:  # a resume whose micro-batch is not the one it began with
        note += (f"\nbatch_size='auto': chosen anew: the run began with micro-batch {kept} on "
                 f"{before.get('memory_device')}, memory_budget={config.get('memory_budget')}, {before['world_size']} "
                 f"process(es)")
    if not (layout["fsdp"] or layout["tp"] > 1):
        b, halved = tried_micro_batch(model, b, share, block_size, device, autocast)
        note += f"\n{halved}" if halved else ""
    if before and same_batches:  # a resume's updates, the same batches, split otherwise than its checkpoint's
        from lib.resume import split_note
        note += "".join("\n" + line for line in split_note(config, b, sequences // b, model.config.dropout))
    return b, f"{note}\n{shared.format(b, share // b)}"


def micro_batch_fits(model, batch_size, block_size, device, autocast):
    """Whether a forward and backward of batch_size sequences fits in the device's memory, leaving no gradients and
    the random state as it was. Not under FSDP or tensor parallel: one process out of memory would stall the rest."""
    x = torch.zeros((batch_size, block_size), dtype=torch.long, device=device)
    cuda = torch.device(device).type == "cuda"
    try:
        with torch.random.fork_rng(devices=[device] if cuda else []):
            with autocast:
                loss = model(x, x)[1]
            loss.backward()
        return True
    except torch.OutOfMemoryError:
        return False
    except RuntimeError as e:  # a CPU's allocator says so in a plain RuntimeError
        if "can't allocate memory" not in str(e):
            raise
        return False
    finally:
        loss = None
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)


def tried_micro_batch(model, b, share, block_size, device, autocast):
    """batch_size='auto': micro-batch b tried in every process (micro_batch_fits); where any runs out of memory,
    halved to the largest divisor of share (a process's sequences an update) at most b / 2 and tried again, until one
    fits in all -> (micro-batch, a line saying so, or None); UserError where one sequence does not."""
    tried = b
    while not smallest(int(micro_batch_fits(model, b, block_size, device, autocast)), device):
        if b == 1:
            raise UserError("batch_size='auto': one sequence ran out of memory in a try although the estimate let it "
                            "fit; turn on gradient_checkpointing, lower block_size, or set memory_budget lower")
        b = max(d for d in range(1, b // 2 + 1) if share % d == 0)
    return b, None if b == tried else (f"batch_size='auto': micro-batch {tried} ran out of memory in a try: halved "
                                       f"to {b}, which fit")


def smallest(value, device):
    # the smallest of every process's value (an int), this process's own where it runs alone
    if not dist.is_initialized():
        return value
    value = torch.tensor([value], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return int(value.item())
