"""torchrun whose workers are forked from it: `python tests/torchrun_fork.py ARGS SCRIPT ...` is
`torchrun --start-method=fork --run-path ARGS /abs/SCRIPT ...` with the project's folder first on sys.path, as
`python train.py` has it.

Started from the tests' fork server (forkserver.py), which has torch imported, each worker of each (re)start is a
fork of this launcher, not a new Python: ~5 s of CPU saved each, which the tests of torchrun's restarts and of
kills under it would pay ~40 times. torchrun's own part is the same either way (its rendezvous, the environment
it gives its workers, its restarts, its report of a failure); a worker differs only in being a fork, as with
torchrun's own --start-method for function entrypoints. The suite's standard DDP run (helpers.standard_run) and
the SIGTERM test keep torchrun's plain launch, a new Python per worker, as users run it."""

import os
import sys

from torch.distributed.run import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT
args = sys.argv[1:]
script = next(i for i, a in enumerate(args) if a.endswith(".py"))  # torchrun's own arguments come first
main(["--start-method=fork", "--run-path", *args[:script], os.path.join(ROOT, args[script]), *args[script + 1:]])
