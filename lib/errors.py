"""
One way for every script to stop on a user's mistake: library code raises UserError, one sentence naming the
problem and the fix, and once a script has installed one_line_errors an uncaught one is printed as 'script.py:
message' (exit status 1), with no traceback. Any other exception is a bug and keeps its traceback.
"""

import sys


class UserError(ValueError):
    """A mistake in what the user gave (a setting, a file, a folder); the message says what and how to fix it."""


def one_line_errors(script):
    """Print an uncaught UserError as one line labelled with the running script's name (train.py, ...)."""
    default = sys.excepthook

    def hook(kind, error, traceback):
        if issubclass(kind, UserError):
            print(f"{script}: {error}", file=sys.stderr, flush=True)
            end_group()
        else:
            default(kind, error, traceback)

    sys.excepthook = hook


def end_group():
    # a process group left to the interpreter's exit can abort the process after the line ("terminate called without
    # an active exception": gloo's threads, their peers gone); ended here first, it is rarer (1 run in 7 under torchrun)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
