"""
torchrun for a job that a scheduler stops: torch.distributed.run with its arguments as they are, except that it
ends in one line instead of a traceback where its workers already said why:
- a SIGTERM it gets (Slurm's preemption, time limit or requeue, sent to every process of the job), once its workers,
  which got the signal too, have finished their step, saved and exited (train.py's StopRequest): status 0. torchrun
  gives them 30 s before it kills them, as Slurm's KillWait does by default;
- workers that failed (a refusal, each in its line above; an error, its traceback above; a signal): status 1.

    python -m lib.launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT train.py ...
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as e:  # its workers stopped as asked: the run stopped, not failed
        print(f"torchrun: {e.sigval.name}, its workers stopped", file=sys.stderr, flush=True)
        sys.exit(0)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        how = f"by {failure.signal_name()}" if failure.exitcode < 0 else f"with exit code {failure.exitcode}"
        more = f" (and {len(e.failures) - 1} more)" if len(e.failures) > 1 else ""
        print(f"torchrun: {e.name}'s rank {rank}{more} ended {how}; its own lines above say why", file=sys.stderr,
              flush=True)
        sys.exit(1)
