"""
A run's records, the master's only: out_dir/metrics.jsonl, one JSON object a line, and where asked Weights & Biases
and TensorBoard; and the run's clock: the time left, the finish time and the wall time its log lines give.

    log, close = open_log("out", {"learning_rate": 6e-4}, master=True)
    log({"iter": 10, "loss": 2.5})
    clock = start_clock()
    seconds, note = time_left(clock, 20, max_iters=5000, eval_interval=250, step_seconds=0.12, steps=10)
"""

import contextlib
import errno
import glob
import json
import math
import os
import shutil
import time

import torch

from lib.files import UserError, open_own

# train.py imports this at its top: the wall time (its last line) counts from the script's start, less its torch import
STARTED = time.time()
WARMUP_STEPS = 3  # a process's first steps (compiling, caches, the allocator) are slow: the estimate skips them
RECENT_STEPS = 50  # the time left follows the mean step time over about this many of the latest steps
TAIL_BYTES = 1 << 16  # a record is a few hundred bytes: an unfinished one lies within the file's last 64 KiB
FINISH_SHOWN = 3  # the first this many estimates also give the finish time on the clock


def open_log(out_dir, config, master, wandb_log=False, wandb_project="gpt", wandb_run_name="run",
             tensorboard_log=False, step=None):
    """(log, close): log(record) writes a record (a dict, the step as "iter") everywhere asked; close() flushes
    TensorBoard. Both do nothing outside the master. step: the run's first (a resume's checkpoint's; None: append):
    earlier records past it go from metrics.jsonl and TensorBoard (all of it from scratch) as this run redoes them."""
    if not master:
        return (lambda record: None), (lambda: None)
    if wandb_log:  # optional: imported only when asked for
        import wandb
        try:
            wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=out_dir)
        except Exception as e:  # not logged in, no network, ...: wandb's own errors are many
            raise UserError(f"wandb_log=True: Weights & Biases did not start ({str(e).strip().splitlines()[0]}): "
                            f"run `wandb login`, or set wandb_log=False") from None
    earlier, cut = cut_records(os.path.join(out_dir, "metrics.jsonl"), step)  # the run's wall time so far
    failed, opened = False, time.time() - earlier
    tensorboard, anew = open_tensorboard(out_dir, step, cut, tensorboard_log)

    def dashboards(record, replayed=False):
        # an evaluation's numbers under eval/: the same step's update record has its own loss and lr
        nonlocal tensorboard
        numbers = {("eval/" if "val_loss" in record else "") + key: value for key, value in record.items()
                   if key != "iter" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if wandb_log and not replayed:
            wandb.log(numbers, step=record["iter"])
        elapsed = record.get("elapsed_s") if replayed else None  # a record given again: at its time, on this clock
        try:
            for key, value in numbers.items() if tensorboard else ():
                tensorboard.add_scalar(key, value, record["iter"], walltime=opened + elapsed if elapsed else None)
        except OSError as e:  # its writer's thread met a full disk: as metrics.jsonl's, no reason to lose the run
            print(f"warning: cannot write {out_dir}/tb ({e.strerror or e}); training goes on without TensorBoard")
            tensorboard = None

    for record in kept_records(os.path.join(out_dir, "metrics.jsonl")) if anew and tensorboard else ():
        dashboards(record, replayed=True)

    def log(record):
        nonlocal failed
        record = {**record, "elapsed_s": round(time.time() - opened, 3)}  # the run's wall time (plot.py's), resumes too
        # standard JSON, which has no NaN or Infinity: a skipped update's non-finite loss or norm is null (jq, node)
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        line = (json.dumps(finite, allow_nan=False) + "\n").encode()
        try:
            with open_own(os.path.join(out_dir, "metrics.jsonl"), "ab") as f:
                end = f.seek(0, os.SEEK_END)
                if os.write(f.fileno(), line) < len(line):  # the disk filled within it: the piece goes, or the
                    os.ftruncate(f.fileno(), end)  # records written once there is room again would join its line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except (OSError, UserError) as e:  # a record lost is no reason to lose the run: said once
            if not failed:
                why = e.strerror if isinstance(e, OSError) else "a symbolic link, never written through"
                print(f"warning: cannot write {out_dir}/metrics.jsonl ({why}); training goes on without it")
            failed = True
        if wandb_log or tensorboard:
            dashboards(record)

    def close():  # TensorBoard writes out what it buffers (a full disk: said at its record already)
        with contextlib.suppress(OSError):
            return tensorboard and tensorboard.close()
    return log, close


def set_aside(out_dir):
    """A run that begins anew where an earlier one left records but no checkpoint (it died before its first, or its
    checkpoints were moved away): those records kept as metrics.jsonl.old and tb.old (in place of any kept before),
    not lost -> a note, or None. One that cannot move stays (its first record says why, and the run goes on)."""
    moved = []
    for name in [n for n in ("metrics.jsonl", "tb") if os.path.lexists(os.path.join(out_dir, n))]:
        path = os.path.join(out_dir, name)
        with contextlib.suppress(OSError):
            if os.path.isdir(path + ".old") and not os.path.islink(path + ".old"):
                shutil.rmtree(path + ".old")
            os.replace(path, path + ".old")
            moved.append(name)
    return (f"note: {' and '.join(moved)} of an earlier run that left no checkpoint here kept as "
            f"{' and '.join(name + '.old' for name in moved)}" if moved else None)


def open_tensorboard(out_dir, step, cut, wanted):
    """(a SummaryWriter for out_dir/tb where wanted, else None; whether open_log gives it metrics.jsonl's kept records
    first). From scratch (step 0), or where metrics.jsonl held records past the step (cut: a process killed between
    checkpoints), the events there no longer match it (TensorBoard's fast loader reads no purge_step): they go, wanted
    or not; so do events older than metrics.jsonl's last record (a run without TensorBoard, or a writer killed
    before it wrote out what it held), wanted. A writer with no events left gets the kept records; else the events go
    on (purge_step for TensorBoard's older loader). A folder that cannot be written: said, and the run goes on."""
    events = glob.glob(os.path.join(glob.escape(out_dir), "tb", "events.out.tfevents.*"))
    if not events and not wanted:
        return None, False
    try:
        behind = max(map(os.path.getmtime, events)) <= os.path.getmtime(os.path.join(out_dir, "metrics.jsonl"))
    except (OSError, ValueError):  # no events, or no metrics.jsonl
        behind = False
    try:
        for old in events if step == 0 or cut or behind and wanted else ():
            os.remove(old)
        if not wanted:
            return None, False
        from torch.utils.tensorboard import SummaryWriter
        anew = step == 0 or cut or behind or not events
        return SummaryWriter(os.path.join(out_dir, "tb"), purge_step=None if anew or step is None else step + 1), anew
    except OSError as e:
        print(f"warning: cannot write {out_dir}/tb ({e.strerror or e})"
              + ("; training goes on without TensorBoard" if wanted else ": its events are not this run's"))
        return None, False


def kept_records(path):
    # the records of metrics.jsonl (cut_records leaves whole lines), each a dict with its step (and its time, if
    # any, a number); a line that is none is left out, and a link never read through
    with contextlib.suppress(OSError), os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):  # (a UnicodeDecodeError is one)
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("iter"), int) and \
                        isinstance(record.get("elapsed_s", 0), (int, float)):
                    yield record


def cut_records(path, step):
    """Drop an unfinished last line (a process killed mid-write, cut at a page's edge), which the next record would
    join, breaking the file; then (step not None) the first record past step and all after (records are in step
    order), which a resumed run writes again: else a resume from an earlier checkpoint would leave steps twice.
    Returns (the last record kept's elapsed_s (0 if none): where a resumed run's clock goes on from, whether any
    line was cut)."""
    elapsed, cut = 0.0, False
    if not os.path.lexists(path):
        return elapsed, cut
    with contextlib.suppress(OSError, UserError), open_own(path, "a+b") as f:  # log() says once why it fails
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - TAIL_BYTES))
        tail = f.read()
        if tail and not tail.endswith(b"\n"):  # no newline in the tail: the whole tail is the piece
            f.truncate(size - len(tail) + tail.rfind(b"\n") + 1)
            cut = True
        f.seek(0)
        at = 0  # where the line read begins
        for line in f if step is not None else ():
            with contextlib.suppress(ValueError, AttributeError, TypeError):  # a line that is no record: kept
                record = json.loads(line)
                if record.get("iter", step) > step:
                    f.truncate(at)
                    cut = True
                    break
                seconds = float(record.get("elapsed_s", elapsed))
                elapsed = seconds if 0 <= seconds < math.inf else elapsed  # (a hand-made NaN goes no further)
            at += len(line)
    return elapsed, cut


def perplexity(loss):
    # e^loss; inf near a float's limit (e^710 overflows), NaN for NaN
    return math.inf if loss >= 700 else math.exp(loss)


def report_evaluation(log, master, step, losses, task_scores, epoch, lr):
    """Print, log an evaluation: losses {train, val, train_accuracy, val_accuracy}, task_scores {task/metric: value}."""
    val_ppl = perplexity(losses["val"])
    if master:
        print(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, val perplexity "
              f"{val_ppl:.2f}, val accuracy {losses['val_accuracy']:.1%}, epoch {epoch:.2f}")
        if task_scores:
            print(f"step {step}: " + ", ".join(f"{name} {value:.4f}" for name, value in task_scores.items()))
    log({"iter": step, "loss": losses["train"], "val_loss": losses["val"], "val_ppl": val_ppl,
         "accuracy": losses["train_accuracy"], "val_accuracy": losses["val_accuracy"], "lr": lr, "epoch": epoch,
         **task_scores})


def evaluations_left(steps_done, max_iters, eval_interval):
    # at every multiple of eval_interval from steps_done (a step is evaluated before its update) and at max_iters
    multiples = max_iters // eval_interval - (steps_done - 1) // eval_interval
    return max(0, multiples + (max_iters % eval_interval != 0))


def seconds_left(intervals, eval_seconds, steps_done, max_iters, eval_interval):
    """The seconds a run has left after steps_done updates: each update at the mean step time of intervals, recent
    (steps, seconds), and each evaluation to come at eval_seconds, the last one's with its save (None: 0)."""
    step_seconds = sum(seconds for _, seconds in intervals) / sum(steps for steps, _ in intervals)
    evaluations = evaluations_left(steps_done, max_iters, eval_interval) * (eval_seconds or 0.0)
    return (max_iters - steps_done) * step_seconds + evaluations


def duration(seconds):
    """A time span as a person reads it: '45s', '12m05s', '2h03m', '3d04h'."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def finish_time(seconds, now=None):
    """The local clock time seconds from now: '14:32' today, '2026-11-27 14:32' on another day."""
    now = time.time() if now is None else now
    end = time.localtime(now + seconds)
    return time.strftime("%H:%M" if end[:3] == time.localtime(now)[:3] else "%Y-%m-%d %H:%M", end)


def start_clock():
    """What the time left is estimated from, measured in this process only; the loop sets eval_seconds."""
    return {"steps": 0, "intervals": [], "eval_seconds": None, "estimates": 0}


def time_left(clock, steps_done, max_iters, eval_interval, step_seconds, steps):
    """After a log interval of steps updates, step_seconds each (evaluations and saves left out), ending at
    steps_done -> (the seconds left, None in the warm-up; the log line's note: ', 12m05s left, ends ~14:32')."""
    warm = clock["steps"] >= WARMUP_STEPS  # the interval began after this process's first steps
    clock["steps"] += steps
    if not warm:
        return None, ""
    intervals = clock["intervals"] = [*clock["intervals"], (steps, step_seconds * steps)]
    while sum(n for n, _ in intervals[1:]) >= RECENT_STEPS:  # the oldest goes while the rest are enough
        intervals.pop(0)
    left = seconds_left(intervals, clock["eval_seconds"], steps_done, max_iters, eval_interval)
    clock["estimates"] += 1
    untimed = clock["eval_seconds"] is None and evaluations_left(steps_done, max_iters, eval_interval) > 0
    # no finish date past 30 years (max_iters=sys.maxsize: until an early stop), which time.localtime may not reach
    finish = f", ends ~{finish_time(left)}" if clock["estimates"] <= FINISH_SHOWN and left < 1e9 else ""
    return left, f", {duration(left)} left{' (evaluations not timed yet)' if untimed else ''}{finish}"


class Speedometer:
    """Steps since the last log line: their time (less evaluations, saves) and the attention keys their queries met."""

    def __init__(self):
        self.restart()

    def restart(self):
        self.since, self.steps, self.keys = time.time(), 0, 0.0

    def pause(self, seconds):  # time spent on something else than training
        self.since += seconds

    def step(self, keys):
        self.steps += 1
        self.keys += keys

    def seconds_per_step(self):
        return (time.time() - self.since) / self.steps


def utilization(model, block_size, keys, tokens_per_s, peak):
    """A process's MFU at tokens_per_s in PaLM's convention (every query against all block_size keys, as nanoGPT) and
    of the FLOPs run (keys: those a query met) -> (mfu, mfu_run, the log line's note), None where peak is unknown."""
    flops = [model.flops_per_token(block_size, k) * tokens_per_s for k in (None, keys)]
    mfu, mfu_run = (f / peak if peak else None for f in flops)
    return mfu, mfu_run, f"{mfu:.1%} PaLM, {mfu_run:.1%} run" if mfu else "n/a"


def wall_time(steps_done):
    """The run's last line: its wall time, counted from train.py's start (this process's, after a resume)."""
    return f"run ended at step {steps_done}: wall time {duration(time.time() - STARTED)} since train.py started"


def attended_keys(doc_ids):
    """The keys a batch's queries attend to under doc_mask (1 + 2 + ... + n in a document of n tokens), a 0-d tensor
    on doc_ids' device. doc_ids never decrease along a row: a document begins where its number first appears."""
    positions = torch.arange(doc_ids.size(1), device=doc_ids.device)
    begins = torch.searchsorted(doc_ids, doc_ids)  # (B, T): where each token's document begins
    return (positions - begins + 1).sum()
