"""
torchrun for a job that a scheduler stops: torch.distributed.run with its arguments as they are, except that a
SIGTERM it gets (Slurm's preemption, time limit or requeue, sent to every process of the job) ends it with one line
instead of a traceback, once its workers, which got the signal too, have finished their step, saved and exited
(train.py's StopRequest). torchrun gives them 30 s before it kills them, as Slurm's KillWait does by default.

    python -m lib.launch --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT train.py ...
"""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as e:  # its workers stopped as asked: the run stopped, not failed
        print(f"torchrun: {e.sigval.name}, its workers stopped", file=sys.stderr, flush=True)
        sys.exit(0)
