"""
Checkpoints: a run's state written, and found again. An out_dir keeps the layout its run began with: files (ckpt.pt,
the master's, gathered from any shards) or, begun under FSDP or tensor parallel, sharded folders (ckpt/,
torch.distributed.checkpoint's: each process writes its own shards; the master's state.pt holds all else). Either
loads into any layout, by parameter name (resume.py reads them back); ckpt_best and ckpt_NNNNNNN follow the same
layout.

Nothing is ever half written: a file is written under a temporary name, flushed and renamed; a folder counts only
with its state.pt, written after every shard and deleted before any (publish).

    save("out", state, model, optimizers, sharded=False, lora=False)     # out/ckpt.pt
    find_checkpoint("out/ckpt.pt")                                        # 'out/ckpt.pt', or a sharded out/ckpt
"""

import contextlib
import errno
import fcntl
import glob
import os
import re
import resource
import shutil
import time
import warnings

import torch
import torch.distributed as dist

from lib.files import UserError, durable_replace, open_own, unwritable
from lib.parallel import is_dtensor


def dcp():
    # imported only where shards are read or written: ~1.3 s at a start that a run of files never needs
    import torch.distributed.checkpoint
    return torch.distributed.checkpoint


# the loop's state as a run begins (evaluated: the step's evaluation is done; a save on a signal may lack it)
LOOP = {"iter_num": 0, "best_val_loss": float("inf"), "evals_without_gain": 0, "skipped_in_a_row": 0,
        "evaluated": False}
NEEDED = {"model", "optimizer", "scaler", "model_args", "config", "world_size", "rng", *LOOP}  # what one holds
# an out_dir's names, in either layout: the copies a save makes, every checkpoint (a folder stepping aside as .old
# too), and what a killed save leaves unfinished, or a killed start (check_room's and start.check_shared's probes)
COPIES = r"ckpt_(best|[0-9]+|epoch_[0-9]+)(\.pt)?"
NAMES = r"ckpt(_best|_[0-9]+|_epoch_[0-9]+)?(\.pt|\.old)?"
UNFINISHED = r"ckpt.*\.tmp|\.write-test-\d+\.tmp|\.shared-[0-9a-f]{16}"
FORMAT = 2  # what its values mean; a resume takes this format alone (an older one: resume with its train.py)


# -----------------------------------------------------------------------------
# finding


def find_checkpoint(path):
    """The checkpoint train.py wrote under a name ('out/ckpt.pt' or 'out/ckpt'), or None: out/ckpt.pt, else the
    sharded folder out/ckpt/, else out/ckpt.old/ (a save killed between publish's two renames); a folder counts
    only with its state.pt. An out_dir holds one layout: ckpt.pt wins over any folder, whatever step it claims."""
    if os.path.isfile(path) and not path.endswith(".pt"):
        return path  # a file named otherwise: the caller's own
    stem = path.removesuffix(".pt").rstrip("/")
    if os.path.isfile(stem + ".pt"):
        return stem + ".pt"
    return next((p for p in (stem, stem + ".old") if os.path.isfile(os.path.join(p, "state.pt"))), None)


def recover_first_save(out_dir):
    """A run's first save killed among its copies (ckpt_best, ckpt_epoch_N, ckpt_NNNNNNN), before its tmp took the
    name ckpt, left one or more beside the tmp and no ckpt: the copies were made from the finished tmp, which makes
    those it had not made yet (the names it keeps) and takes the name now, so that the run resumes from it. The master
    calls it at start, out_dir locked."""
    names = os.listdir(out_dir)
    if any(re.fullmatch(COPIES, name) for name in names) and not find_checkpoint(os.path.join(out_dir, "ckpt.pt")):
        if "ckpt.pt.tmp" in names:
            tmp, rename = os.path.join(out_dir, "ckpt.pt.tmp"), durable_replace
        elif os.path.isfile(os.path.join(out_dir, "ckpt.tmp", "state.pt")):  # (state.pt: a folder's last file)
            tmp, rename = os.path.join(out_dir, "ckpt.tmp"), publish
        else:
            return
        from lib.resume import load_checkpoint
        state = load_checkpoint(tmp, mmap=True, weights=False, verify=False)
        copies = state.get("copies") if isinstance(state, dict) else None
        for name in copies if isinstance(copies, list) else []:
            if isinstance(name, str) and re.fullmatch(COPIES, name) and name not in names:  # (a name, not a path)
                retire(os.path.join(out_dir, name + ".tmp"))
                copy_checkpoint(tmp, os.path.join(out_dir, name))
        rename(tmp, tmp.removesuffix(".tmp"))


def latest(out_dir, sharded=False):
    """(path, step) of out_dir's latest checkpoint (sharded: the folder ckpt/ first), or None."""
    from lib.resume import load_checkpoint
    found = find_checkpoint(os.path.join(out_dir, "ckpt" + ("" if sharded else ".pt")))
    return (found, load_checkpoint(found, mmap=True, weights=False, verify=False)["iter_num"]) if found else None


def last_good(out_dir):
    good = latest(out_dir)
    return f"{good[0]}, from step {good[1]}, is the last good state" if good else "no checkpoint was saved before it"


def diverged(out_dir, skipped):
    """The UserError that stops a run whose last `skipped` updates had a non-finite loss or gradient."""
    return UserError(f"{skipped} update{'s' if skipped > 1 else ''} in a row had a non-finite loss or gradient; "
                     f"stopped, and {last_good(out_dir)} (lower learning_rate, or check the data)")


def check_finite(model, out_dir, step):
    """UserError in every process, before any write, where a trained weight (in any process's part) is not finite."""
    trained = [p.to_local() if is_dtensor(p) else p for p in model.parameters() if p.requires_grad]
    finite = torch.stack([torch.isfinite(p).all() for p in trained]).all().float().view(1)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise UserError(f"the weights hold a NaN or an infinite value at step {step}: not saved, and "
                         f"{last_good(out_dir)} (lower learning_rate, or check the data)")


def first_line(error, named=False):
    # an error's first line for a message of ours; an empty one (a 0-byte file's) by its kind; named: after its kind
    # where the line alone says little ("101", a KeyError's)
    line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {line}" if named and line else line or type(error).__name__


# -----------------------------------------------------------------------------
# writing


def write_file(state, path):
    # state saved as path, on the disk: a save's tmp, which takes its checkpoint's name once the save is finished
    with open_own(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


FICLONE = 0x40049409  # Linux's ioctl that makes a file share another's blocks until either is written


def copy_file(src, dst):
    # dst a file of its own with src's bytes (unlike a hard link, writing one leaves the other): a copy-on-write
    # clone where the file system makes them (btrfs, XFS: nothing copied), else the bytes copied; fsynced
    with open(src, "rb") as source, open_own(dst, "wb") as target:
        try:
            fcntl.ioctl(target.fileno(), FICLONE, source.fileno())
        except OSError:  # (ext4, and every system but Linux)
            shutil.copyfileobj(source, target, 1 << 24)
        target.flush()
        os.fsync(target.fileno())


def retire(path):
    # delete a checkpoint file or folder; a folder's state.pt first (see above)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "state.pt")):
            os.remove(os.path.join(path, "state.pt"))
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.remove(path)


def publish(tmp, dst):
    # the finished folder tmp takes the name dst. A folder cannot replace another in one rename: the old one steps
    # aside as dst.old first, whole where a kill comes between (find_checkpoint takes it; the next save removes it)
    old = dst + ".old"
    if os.path.isdir(dst):
        clear(old)
        durable_replace(dst, old)
    durable_replace(tmp, dst)
    clear(old)


def clear(old):
    # remove publish's old folder, and those set aside before: one that will not go (a reader's NFS file held open
    # in it) is set aside as old.N, for a later save to remove, and never stops a save
    for path in [old, *glob.glob(glob.escape(old) + ".*")]:
        with contextlib.suppress(OSError):
            retire(path)
    with contextlib.suppress(OSError):  # none left, or the rename refused (then publish's own onto it says why)
        os.rename(old, f"{old}.{time.time_ns()}")


def copy_checkpoint(src, dst):
    # dst becomes a copy of the checkpoint src, a file or a folder, of files of its own (copy_file)
    tmp = dst + ".tmp"  # (write_checkpoint removed any a killed save left)
    if os.path.isdir(src):
        os.makedirs(tmp)
        for name in sorted(os.listdir(src), key=lambda n: n == "state.pt"):  # state.pt last
            copy_file(os.path.join(src, name), os.path.join(tmp, name))
        publish(tmp, dst)
    else:
        copy_file(src, tmp)
        durable_replace(tmp, dst)


def trained_only(model, state):
    # a state dict's entries for the parameters that train (under LoRA the adapters: the base is its folder's)
    trained = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    return {n: t for n, t in state.items() if n in trained}


def sharded_state(model, optimizers, lora):
    # this process's shards of the weights (LoRA: the adapters) and optimizers' tensors, by name: any layout loads them
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(model, optimizers)
    return trained_only(model, model_state) if lora else model_state, optim_state


def parameter_names(model, optimizer):
    # the names of the optimizer's parameters, in the order its state_dict numbers them
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def whole_state(model, optimizers):
    """The weights and the first optimizer's state in torch's own layout (parameters by index), gathered from any
    FSDP or tensor parallel shards onto the master's CPU (every process must call it then; the others get nothing)."""
    if not any(is_dtensor(p) for p in model.parameters()):
        return model.state_dict(), optimizers[0].state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    weights, optim = get_state_dict(model, optimizers, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not optim:  # not the master
        return weights, optim
    index = {n: i for i, n in enumerate(parameter_names(model, optimizers[0]))}
    return weights, {"state": {index[n]: moments for n, moments in optim["state"].items()},
                     "param_groups": optimizers[0].state_dict()["param_groups"]}


def save(out_dir, state, model, optimizers, sharded, lora, improved=False, keep_last_n=0, finished_epoch=None):
    """Write the run's checkpoint (every process calls it) in out_dir's layout: state (plain values) and the model's
    and optimizers' tensors; also as ckpt_best when improved, ckpt_NNNNNNN keeping the last keep_last_n, and
    ckpt_epoch_N at the end of epoch N. A save that cannot be written removes what it began and raises UserError in
    one line (what, why, which checkpoint is intact) in every process, or the others would wait for this one."""
    check_finite(model, out_dir, state["iter_num"])
    failed = None
    try:
        write_checkpoint(out_dir, state, model, optimizers, sharded, lora, improved, keep_last_n, finished_epoch)
    except UserError as e:  # a save that is not whole (check_shards)
        failed = str(e)
    except (OSError, RuntimeError, dcp().api.CheckpointException) as e:
        # torch.save says "unexpected pos" for a full disk or ulimit -f's limit: failed_save tells which by the size
        model_state = trained_only(model, model.state_dict()) if lora else model.state_dict()
        copies = 1 + bool(improved) + (keep_last_n > 0) + (finished_epoch is not None)  # it, and each of its copies
        needed = copies * nested_bytes([model_state] + [opt.state_dict()["state"] for opt in optimizers])
        failed = failed_save(out_dir, state["iter_num"], sharded, e, needed)
    if dist.is_initialized() and dist.get_world_size() > 1:
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failed)
        if any(failures) and failed is None:
            failed = "another process could not write the checkpoint (its error is above)"
    if failed:
        raise UserError(failed)


def nested_bytes(tree):
    # the bytes of the tensors in nested dicts and lists (a sharded tensor's whole size: every shard's)
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return sum(nested_bytes(v) for v in values)


def failed_save(out_dir, step, sharded, error, needed):
    # the one line for a failed save, once the master removed what it began (the others' shards are in its folders):
    # its tmp, and where no ckpt was ever published, the copies it made (with none, the run begins again)
    master = not dist.is_initialized() or dist.get_rank() == 0
    names = os.listdir(out_dir) if master and os.path.isdir(out_dir) else []
    first = bool(names) and not find_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    for name in [name for name in names if re.fullmatch(UNFINISHED, name) or first and re.fullmatch(COPIES, name)]:
        retire(os.path.join(out_dir, name))
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: {rank: (its error, its stack)}
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]  # the first failed rank's own (a folder gone, a disk full, ...)
    why = error.strerror if isinstance(error, OSError) and error.strerror else first_line(error)
    code = getattr(error, "errno", None)
    full = code in (errno.ENOSPC, errno.EDQUOT)
    with contextlib.suppress(OSError):  # (the folder itself is gone: the error says why)
        free = shutil.disk_usage(out_dir).free  # torch.save's "unexpected pos" may be the disk's: so its room says
        if full := full or free < needed and not isinstance(error, OSError):
            why = (f"No space left on device: about {needed / 2**20:,.1f} MB needed for it and its copies, "
                   f"{free / 2**20:,.1f} MB free")
    last = latest(out_dir, sharded)
    kept = f"{last[0]} from step {last[1]} is intact" if last else "no earlier checkpoint was written"
    limited = not full and resource.RLIM_INFINITY != resource.getrlimit(resource.RLIMIT_FSIZE)[0] < needed  # ulimit -f
    fix = ("raise the file size limit (ulimit -f), or move out_dir to a file system of larger files" if limited
           or code == errno.EFBIG else "make out_dir writable again (its permissions, or a mount gone read-only)"
           if code in (errno.EACCES, errno.EPERM, errno.EROFS) else "make room (or move out_dir)")
    return (f"could not write the checkpoint of step {step} in {out_dir} ({why}); {kept}: {fix}, then resume with "
            f"--init_from=auto")


def check_room(out_dir, size, keep_last_n=0, epoch_copies=0):
    """Before the first step: UserError in one line where out_dir cannot be written or hold one checkpoint of size
    bytes (memory_estimate's); a warning (returned, else None) where it cannot hold what a save holds at its peak:
    the last checkpoint and the new one, ckpt_best and its new copy, keep_last_n step copies and the new one (the
    room of those there already counted), and the epoch_copies ckpt_epoch_N the run will write and keep (the ones
    there are kept too: their room does not count)."""
    probe = os.path.join(out_dir, f".write-test-{os.getpid()}.tmp")  # a name no other process writes
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open_own(probe, "wb") as f:
            f.write(b"0")
            f.flush()
            os.fsync(f.fileno())
        free = shutil.disk_usage(out_dir).free
    except OSError as e:
        raise UserError(unwritable(out_dir, e)) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    room = f"{free / 2**20:,.1f} MB free in {out_dir}, and a checkpoint takes about {size / 2**20:,.1f} MB"
    if free < size:
        raise UserError(f"{room}: make room, or choose another out_dir")
    held = 4 + (keep_last_n + 1 if keep_last_n else 0) + epoch_copies
    there = 0  # the bytes of the checkpoints there (a resume's), files and sharded folders
    for entry in [e for e in os.listdir(out_dir) if re.fullmatch(NAMES, e) and not e.startswith("ckpt_epoch_")]:
        path = os.path.join(out_dir, entry)
        walked = os.walk(path) if os.path.isdir(path) else [(out_dir, None, [entry])]
        there += sum(os.path.getsize(os.path.join(folder, f)) for folder, _, files in walked for f in files)
    if free + there < held * size:
        return (f"warning: {room}: a save holds up to {held} at once (the last and the new one, ckpt_best and its new "
                f"copy{', keep_last_n step copies and the new one' if keep_last_n else ''}"
                f"{f', and {epoch_copies} epoch copies kept' if epoch_copies else ''}), which will not all fit")
    return None


def check_shards(tmp, latest):
    # Every shard .metadata names is in tmp, whole, before tmp becomes a checkpoint: another node's shards are
    # elsewhere where out_dir is not shared (start.check_shared refuses that at start; a mount can still vanish)
    from lib.dcp_metadata import missing_shards, read_metadata
    if missing := missing_shards(tmp, read_metadata(tmp)):
        retire(tmp)
        raise UserError(f"the sharded checkpoint in {tmp} lacks {missing[0]} (of {len(missing)} missing shard "
                        f"files), written where this node cannot see it: put out_dir on storage every node shares; "
                        f"{latest} is left as it was")


def write_checkpoint(out_dir, state, model, optimizers, sharded, lora, improved, keep_last_n, finished_epoch):
    master = not dist.is_initialized() or dist.get_rank() == 0
    suffix = "" if sharded else ".pt"
    latest = os.path.join(out_dir, "ckpt" + suffix)
    tmp = latest + ".tmp"
    swept = None
    if master:  # what killed saves left unfinished (no save is under way now)
        try:
            for name in os.listdir(out_dir):
                if re.fullmatch(UNFINISHED, name):
                    retire(os.path.join(out_dir, name))
        except OSError as e:  # (out_dir gone, or its mount): every process fails with it, not at another collective
            swept = e
    if dist.is_initialized() and dist.get_world_size() > 1:  # the others wait for the sweep before they write
        said = [swept]
        dist.broadcast_object_list(said, src=0)
        swept = said[0]
    if swept:
        raise swept
    # the copies this save makes, kept in it: a first save killed part way through them has the rest made at the next
    # start (recover_first_save)
    wanted = {"ckpt_best": improved, f"ckpt_epoch_{finished_epoch}": finished_epoch is not None,
              f"ckpt_{state['iter_num']:07d}": keep_last_n > 0}
    state["copies"] = [name + suffix for name, on in wanted.items() if on]
    if sharded:
        # the optimizers' settings (plain values) go into state.pt; dcp.save returns on the master once all wrote theirs
        model_state, optim_state = sharded_state(model, optimizers, lora)
        with warnings.catch_warnings():  # without a process group it warns that it writes in one process
            warnings.simplefilter("ignore")
            dcp().save({"model": model_state, "optimizer": optim_state["state"]}, checkpoint_id=tmp)
        if not master:
            return
        write_file({**state, "param_groups": optim_state["param_groups"]}, os.path.join(tmp, "state.pt"))
        check_shards(tmp, latest)
    else:
        weights, optimizer = whole_state(model, optimizers)
        if not master:
            return
        state.update(model=trained_only(model, weights) if lora else weights, optimizer=optimizer,
                     more_optimizers=[opt.state_dict() for opt in optimizers[1:]])  # (optim.build_optimizers's)
        write_file(state, tmp)
    # The copies are made from the finished tmp, which takes the name ckpt last: a save that dies or fills the disk
    # on the way leaves the ckpt before it, whose resume saves this step again, copies and all
    for name in state["copies"]:
        copy_checkpoint(tmp, os.path.join(out_dir, name))
    (publish if sharded else durable_replace)(tmp, latest)
    if keep_last_n > 0:
        rotate_step_copies(out_dir, state["iter_num"], keep_last_n)
    print(f"saved {latest} at step {state['iter_num']}")


def rotate_step_copies(out_dir, step_now, keep_last_n):
    """Retire the step copies ckpt_N beyond the last keep_last_n up to step_now (a later one is of a run gone back
    before it; so is one up to it written before a lower step's, which goes once not among the last steps either)."""
    steps = [(int(m[1]), f) for f in os.listdir(out_dir)
             if (m := re.fullmatch(r"ckpt_([0-9]+)(\.pt|\.old)?", f)) and int(m[1]) <= step_now]
    written = {}
    for step, name in steps:  # a folder's time is its state.pt's (its last file)
        path = os.path.join(out_dir, name, "state.pt") if os.path.isdir(os.path.join(out_dir, name)) else \
            os.path.join(out_dir, name)
        written[step] = max(written.get(step, -1), os.stat(path).st_mtime_ns if os.path.exists(path) else -1)
    written[step_now] = float("inf")  # this save's own, whatever the clock said (stepped back)
    ours = [s for s in sorted(written) if written[s] >= max(written[t] for t in written if t <= s)]  # none newer below
    # times tell runs apart only where nothing rewrote the files (`cp` without -p dates copies in any order):
    # the last keep_last_n steps stay too, so no step copy of this run is ever the one that goes
    kept = set(ours[-keep_last_n:]) | set(sorted(written)[-keep_last_n:])
    for step, old in steps:
        if step not in kept:
            try:  # the save is whole by now: a copy that will not go (a reader's NFS file in it) never stops the run
                retire(os.path.join(out_dir, old))
            except OSError as e:
                print(f"warning: could not remove {os.path.join(out_dir, old)}, an older step's copy "
                      f"({e.strerror or e}): the run goes on; remove it by hand")
