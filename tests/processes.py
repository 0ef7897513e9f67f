"""The processes a test started, found by a mark in their environment, whoever their parent is now.

conftest.py gives every test marked `kills` its own value of PYTEST_PROCESS_MARK; every process it starts
inherits it, and so do the processes those start: torchrun's workers too, which run in sessions of their own and
outlive a killed launcher (its group never reaches them). /proc/PID/environ is the environment a process was
started with, so the pytest process itself, which only set the variable later, never matches; a child of the fork
server shows the server's environment, and is found by the session it leads."""

import os
import signal
import time

from forkserver import MARK, sessions


def marked(value=None):
    # {pid: command line} of the live processes whose environment holds MARK=value (this test's by default), or
    # which belong to a session that a forked run of this test leads (forkserver.py: a child forked, not started,
    # shows its server's environment, without the mark, and so do the processes it forks in turn)
    value = os.environ.get(MARK) if value is None else value
    if not value or not os.path.isdir("/proc"):  # conftest.py tracks processes only where /proc is
        return {}
    needle = f"{MARK}={value}".encode()
    leaders = {str(pid) for pid in sessions.get(value, ())}
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, _, session = f.read().rsplit(")", 1)[1].split()[:4]
            if state in "ZX":  # exited, only not yet reaped
                continue
            if session not in leaders:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def kill_marked(value=None, timeout=30):
    # SIGKILL every process of this test until none is left; returns what was alive
    alive = marked(value)
    seen = dict(alive)
    deadline = time.time() + timeout
    while alive:
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert time.time() < deadline, f"processes that SIGKILL did not end: {alive}"
        time.sleep(0.05)
        alive = marked(value)
    return seen


def wait_unmarked(value=None, timeout=10):
    # the processes of this test still alive after timeout seconds (none, normally)
    deadline = time.time() + timeout
    while (alive := marked(value)) and time.time() < deadline:
        time.sleep(0.1)
    return alive
