"""
One way for every script to stop on a user's mistake. Library code raises UserError with one sentence that
names the problem and the fix; the script that runs installs one_line_errors once, and an uncaught UserError
is then printed as 'script.py: message' (exit status 1), with no traceback. Any other exception is a bug and
keeps its traceback.
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
    # a process group left to the interpreter's exit can abort the process ("terminate called without an active
    # exception": gloo's threads, their peers gone) after the line was said: ended here first, which makes it rarer
    # (a refusal of two processes under torchrun still aborted 1 run in 7 here; the line is said either way)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
