"""
torchrun for a job that a scheduler stops: torch.distributed.run, arguments unchanged, ending in one line instead of
a traceback where its workers already said why:
- on SIGTERM (Slurm's preemption, time limit or requeue, sent to every process of the job, or to one node's
  torchrun), once its workers have finished their step, saved and exited (train.py's StopRequest), and the other
  nodes' torchruns have ended too (their exit barrier, up to EXIT_WAIT): status 0. torchrun kills one still running 30 s
  later (as Slurm's KillWait does by default), losing its steps since the last checkpoint: the line names it, status 1;
- workers that failed (a refusal or traceback above, or a signal): status 1.

    python -m lib.launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT train.py ...
"""

import signal
import sys
import time

import torch.distributed.elastic.utils.store as store_util
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID, SimpleElasticAgent
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

EXIT_WAIT = 30  # s a signalled torchrun waits at the exit barrier for the other nodes' (Slurm's KillWait)
closed = {}  # local rank: exit status of each worker, as torchrun last closed them
_close, _run = SubprocessContext._close, SimpleElasticAgent.run


def run_then_meet_the_others(self, *args, **kwargs):
    # torchrun's run; once a signal has stopped its workers, it meets the other nodes' torchruns at their exit
    # barrier, where theirs, told by their workers that the run stopped, wait for it: a SIGTERM to one node's
    # torchrun left the others waiting there 300 s, then ending in a traceback. (Slurm signals every node.)
    try:
        return _run(self, *args, **kwargs)
    except SignalException:
        if self._worker_group.group_world_size > 1:
            try:  # (torchrun's own _exit_barrier, without its traceback where a node is gone: EXIT_WAIT, then on)
                store_util.barrier(self._store, self._worker_group.group_world_size, _TERMINAL_STATE_SYNC_ID,
                                   barrier_timeout=EXIT_WAIT)
                time.sleep(2)  # and lets them close their rendezvous in the store it may serve (else their warning)
            except Exception:
                pass
        raise


def close_and_keep_statuses(self, *args, **kwargs):
    # torchrun's close of its workers (the signal, its grace, then SIGKILL), each one's exit status kept
    _close(self, *args, **kwargs)
    closed.update({rank: handler.proc.poll() for rank, handler in self.subprocess_handlers.items()})


SubprocessContext._close, SimpleElasticAgent.run = close_and_keep_statuses, run_then_meet_the_others


def ended(status):
    # how a worker ended, by its exit status (None: it had not, even after SIGKILL)
    if status is None:
        return "had not ended"
    return f"ended by {signal.Signals(-status).name}" if status < 0 else f"ended with exit code {status}"


def signalled(signal_name):
    # (torchrun's one line, its exit status) after the signal signal_name ended it, by how its workers ended
    failed = {rank: status for rank, status in sorted(closed.items()) if status != 0}
    # a worker ended by the signal itself got it while it started (importing torch, joining the group), before
    # train.py takes the signal over (StopRequest): it had trained no step, so nothing is lost
    starting = [rank for rank, status in failed.items() if status == -signal.Signals[signal_name]]
    if len(starting) == len(failed) and starting:
        return (f"torchrun: {signal_name}, its workers stopped (local rank {', '.join(map(str, starting))} while "
                f"starting, before a step: nothing to save)", 0)
    if not failed:
        return f"torchrun: {signal_name}, its workers stopped", 0
    return (f"torchrun: {signal_name}, but local rank " + ", ".join(f"{r} {ended(s)}" for r, s in failed.items())
            + " (torchrun kills a worker still running 30 s after the signal): the steps since the last checkpoint "
            "may be lost", 1)


def failed(error):
    # torchrun's one line where its workers failed (error: a ChildFailedError), by the first to fail: its own lines
    # above say why, but not one killed by a signal (the kernel's out-of-memory killer, a kill -9), which said nothing
    rank, failure = error.get_first_failure()
    more = f" (and {len(error.failures) - 1} more)" if len(error.failures) > 1 else ""
    why = "its own lines above say why"
    if failure.exitcode == -signal.SIGKILL:
        why = ("killed from outside (the kernel's out-of-memory killer, a kill -9), it wrote nothing: the other ranks' "
               "errors above follow from its end")
    elif failure.exitcode is not None and failure.exitcode < 0:  # (NCCL's watchdog writes its line, then aborts)
        why = "its lines above, if any, say why"
    return f"torchrun: {error.name}'s rank {rank}{more} {ended(failure.exitcode)}; {why}"


if __name__ == "__main__":
    try:
        main()
    except SignalException as e:  # the run stopped, not failed, where its workers stopped as asked
        line, status = signalled(e.sigval.name)
        print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except ChildFailedError as e:
        print(failed(e), file=sys.stderr, flush=True)
        sys.exit(1)
