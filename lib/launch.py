"""
torchrun for a job that a scheduler stops: torch.distributed.run, arguments unchanged, ending in one line instead of
a traceback where its workers already said why:
- on SIGTERM (Slurm's preemption, time limit or requeue, sent to every process of the job), once its workers have
  finished their step, saved and exited (train.py's StopRequest): status 0. torchrun kills one still running 30 s
  later (as Slurm's KillWait does by default), losing its steps since the last checkpoint: the line names it, status 1;
- workers that failed (a refusal or traceback above, or a signal): status 1.

    python -m lib.launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT train.py ...
"""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

closed = {}  # local rank: exit status of each worker, as torchrun last closed them
_close = SubprocessContext._close


def close_and_keep_statuses(self, *args, **kwargs):
    # torchrun's close of its workers (the signal, its grace, then SIGKILL), each one's exit status kept
    _close(self, *args, **kwargs)
    closed.update({rank: handler.proc.poll() for rank, handler in self.subprocess_handlers.items()})


SubprocessContext._close = close_and_keep_statuses


def ended(status):
    # how a worker ended, by its exit status (None: it had not, even after SIGKILL)
    if status is None:
        return "had not ended"
    return f"ended by {signal.Signals(-status).name}" if status < 0 else f"ended with exit code {status}"


def signalled(signal_name):
    # (torchrun's one line, its exit status) after the signal signal_name ended it, by how its workers ended
    failed = {rank: status for rank, status in sorted(closed.items()) if status != 0}
    if not failed:
        return f"torchrun: {signal_name}, its workers stopped", 0
    return (f"torchrun: {signal_name}, but local rank " + ", ".join(f"{r} {ended(s)}" for r, s in failed.items())
            + " (torchrun kills a worker still running 30 s after the signal): the steps since the last checkpoint "
            "may be lost", 1)


if __name__ == "__main__":
    try:
        main()
    except SignalException as e:  # the run stopped, not failed, where its workers stopped as asked
        line, status = signalled(e.sigval.name)
        print(line, file=sys.stderr, flush=True)
        sys.exit(status)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        more = f" (and {len(e.failures) - 1} more)" if len(e.failures) > 1 else ""
        print(f"torchrun: {e.name}'s rank {rank}{more} {ended(failure.exitcode)}; its own lines above say why",
              file=sys.stderr, flush=True)
        sys.exit(1)
