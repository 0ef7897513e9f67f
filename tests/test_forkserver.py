"""The tests' fork server (forkserver.py) runs a script as a new Python would: the same status, output and exit."""
import os
import subprocess
import sys

import pytest

import forkserver
from helpers import CPU_ENV  # the other tests' values: their server serves these runs too

SCRIPT = """
import atexit, os, sys, weakref
import beside  # a module of the script's folder, compiled by the child

class Made:
    pass

made = Made()
weakref.finalize(made, print, "the script's finalizer")
atexit.register(print, "the script's atexit function")
print(os.path.basename(os.getcwd()), os.environ["ASKED"], beside.VALUE, sys.argv[1:])
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("raised by the script")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["0", "3", "raise"])
def test_a_forked_run_is_a_new_pythons(tmp_path, how):
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "beside.py").write_text("VALUE = 42\n")
    env = {**os.environ, **CPU_ENV, "ASKED": "yes"}
    forked = forkserver.run(["script.py", how], cwd=tmp_path, env=env)
    assert not (tmp_path / "__pycache__").exists()  # its bytecode is kept in the session's folder instead
    assert list(forkserver.pycache.rglob(f"{tmp_path.name}/beside.*.pyc"))
    new = subprocess.run([sys.executable, "script.py", how], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)
    assert forked.returncode == {"0": 0, "3": 3, "raise": 1}[how]
    assert forked.stdout.endswith("the script's atexit function\nthe script's finalizer\n")
    assert forked.stderr.startswith("to stderr\n")


def test_a_script_that_does_not_compile_fails_as_in_a_new_python(tmp_path):
    (tmp_path / "script.py").write_text("print('never')\nx = (\n")
    env = {**os.environ, **CPU_ENV}
    forked = forkserver.run(["script.py"], cwd=tmp_path, env=env)
    new = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)
    assert forked.returncode == 1 and forked.stderr.endswith("SyntaxError: '(' was never closed\n")
