"""Run a script of the project (train.py) in a new process, without paying for `import torch` each time.

A new Python spends ~3-4 s of CPU importing torch and its distributed packages before train.py reads its first
argument, and the tests start the project's scripts about 350 times: ~20 minutes of CPU, more than the whole
suite's budget on 2 cores. So, as multiprocessing's forkserver does, a server process imports those libraries
once and forks a child for each run. The child is a new process as before: its own pid and session, default
signal handlers, its own standard streams, environment and working folder, and whatever the script or a config
file patches dies with it. It only finds torch already imported. The server never imports the project's own
modules, so each child reads them from disk as a new Python would.

The child runs the script in a module __main__ of its own, and leaves the way any Python script does: an
exception is printed as the interpreter prints it (the script's frames only); the script's SystemExit, or its
end, unwinds out of the server's code to the interpreter, which joins the threads left running and runs the
atexit functions and the finalizers of what the script made; the last of these, registered by the server first
of all, flushes the streams and ends the child with the script's status. Skipped are only the teardown of the
modules and the finalizers of what the server's imports made (the server's own). Nothing private is called.
tests/test_forkserver.py compares a forked run with a new Python's.

A few environment variables are read only when Python starts or a library is imported (`FIXED`): a child keeps
its server's values, so a run that asks for other values gets a server of its own for them.

Several runs can start together, as the workers of one distributed run do (run_together): when one of them
fails, the others are killed, as torchrun does with its workers.

    done = run(["train.py", "--max_iters=2"], cwd=ROOT, env=env, timeout=300)  # a CompletedProcess
    ranks = run_together([(["train.py"], {**env, "RANK": "0", ...}), ...], cwd=ROOT, timeout=300)  # a list
"""

import contextlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings

# What the project's scripts import from outside the project; triton only where the tests run it under its
# interpreter (Triton's own helpers are compiled or interpreted as TRITON_INTERPRET was when it was imported).
# torch._dynamo is the costliest: torch's optimizers import it when the first is made (~2-3 s of CPU in every
# train.py run otherwise).
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.device_mesh", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.nn.parallel",
           "torch.utils.checkpoint", "torch._dynamo", "torch.profiler", "safetensors.torch", "tiktoken",
           "tokenizers", "jinja2"]
# read when Python starts, a library is imported or a thread pool starts: a child keeps its server's values
# (TRITON_INTERPRET only as on or not; PYTHONUNBUFFERED each child applies itself)
FIXED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "PYTHONHASHSEED", "PYTHONPATH",
         "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING", "LD_PRELOAD", "LD_LIBRARY_PATH")
# the variable by which conftest.py finds the processes a test started: a server, shared, must not carry it
MARK = "PYTEST_PROCESS_MARK"
# a folder of the test session's own, where the children keep the bytecode of the modules they compile (None: none)
pycache = None

SERVER = r'''
import atexit, gc, importlib, io, os, pickle, random, struct, sys, tempfile, types, weakref
exit_code = 0


def leave():
    # Registered before anything else, so the last of the functions a child runs on its way out (atexit runs
    # them in reverse order, after the interpreter has joined the threads left running): the streams flushed,
    # the child ends there, without tearing down the modules it shares with the server (~4 s of copied pages).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class ServersFinalize(weakref.finalize):
    # What the imports made is the server's, and so is its finalization: a child does not run these finalizers as
    # it exits (torch's unregisters its thousands of operators, ~50 ms of each run). What the child makes is
    # finalized as it exits, as a new Python does.
    __slots__ = ()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.atexit = False


atexit.register(leave)
finalize, weakref.finalize = weakref.finalize, ServersFinalize
for name in sys.argv[1:]:
    importlib.import_module(name)
weakref.finalize = finalize
sys.stdout.flush()  # nothing of the imports' output may wait in a buffer that the children would inherit
sys.stderr.flush()
if os.environ.get("FORKSERVER_PYCACHE"):
    # The children compile the project's modules (~0.08 s of a train.py run's 0.3): their bytecode is kept for the
    # next child in this folder, whatever PYTHONDONTWRITEBYTECODE says, and never beside the sources.
    sys.dont_write_bytecode = False
    sys.pycache_prefix = os.environ.pop("FORKSERVER_PYCACHE")
gc.freeze()  # the children's garbage collector leaves the server's objects alone (and their pages shared)
replies = int(os.environ.pop("FORKSERVER_REPLIES"))


def read(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(0)  # the pytest process is gone: so is the server
        data += chunk
    return data


def reply(value):
    os.write(replies, struct.pack("q", value))


def child(request):
    # what `cd cwd && env -i ENV python SCRIPT ARGS >out 2>err </dev/null` would do, less the imports
    os.setsid()
    os.close(replies)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # appended to: stdout and stderr may be one file (as stderr=STDOUT), and each write must land at its end
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY | os.O_APPEND),
                            (2, request["err"], os.O_WRONLY | os.O_APPEND)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    if os.environ.get("PYTHONUNBUFFERED"):  # as Python makes its streams at its start under -u
        for name, errors in (("stdout", "strict"), ("stderr", "backslashreplace")):
            stream = io.TextIOWrapper(io.FileIO(getattr(sys, name).fileno(), "w", closefd=False), write_through=True,
                                      encoding=getattr(sys, name).encoding, errors=errors)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
    random.seed()  # a new Python draws its seeds afresh; forked children would all share the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None  # TMPDIR is the child's
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(request["path"])
    # the script runs as `python SCRIPT` runs it: in a module __main__ that lives until the process ends
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    main.__file__, main.__cached__ = request["path"], None
    global exit_code
    try:
        with io.open_code(request["path"]) as f:
            exec(compile(f.read(), request["path"], "exec"), vars(main))
    except SystemExit as e:  # the status the interpreter will exit with, as it reads sys.exit's argument
        exit_code = (e.code or 0) if e.code is None or isinstance(e.code, int) else 1
        raise
    except BaseException as e:  # printed as a new Python prints it: the script's frames, not the server's
        exit_code = 1
        e.__traceback__ = e.__traceback__.tb_next
        sys.excepthook(type(e), e, e.__traceback__)
        sys.exit(1)


reply(0)  # ready
while True:
    # A request is a list of runs that go together (the processes of one distributed run): each forked at once,
    # their pids sent back, then each (pid, status) as it ends.
    requests = pickle.loads(read(struct.unpack("q", read(8))[0]))
    pids = []
    for request in requests:
        pid = os.fork()
        if pid == 0:
            # The script's SystemExit or exception goes up to the interpreter, as in `python SCRIPT`, and so does
            # the script's end, by sys.exit: the interpreter prints it, joins the threads, runs atexit's functions.
            child(request)
            sys.exit(0)
        pids.append(pid)
    for pid in pids:
        reply(pid)
    for _ in pids:
        pid, status = os.wait()
        reply(pid)
        reply(status)
'''


class Server:
    def __init__(self, env):
        replies_read, replies_write = os.pipe()
        env = {k: v for k, v in env.items() if k not in (MARK, "PYTHONUNBUFFERED")}  # each child sets its own
        env["FORKSERVER_REPLIES"] = str(replies_write)
        if pycache:
            env["FORKSERVER_PYCACHE"] = str(pycache)
        preload = [*PRELOAD, *(["triton"] if interpreted(env) else [])]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *preload], stdin=subprocess.PIPE, env=env,
                                     stdout=self.log, stderr=self.log, pass_fds=[replies_write], cwd="/",
                                     start_new_session=True)
        os.close(replies_write)
        self.replies = replies_read
        self.started = None  # the Started running, if any: its end is the server's next reply
        self.read_reply()
        self.log.seek(0)
        printed = self.log.read()
        # A child would not print again what the imports printed (a warning, say): then runs start a new Python.
        self.quiet = not printed
        if printed:
            warnings.warn(f"importing {', '.join(preload)} printed something, so each run of a script starts a "
                          f"new Python (slower): {printed[:300]!r}")

    def read_reply(self, timeout=None):
        # the server's next 8-byte integer, or None after timeout seconds
        data = b""
        deadline = None if timeout is None else time.monotonic() + timeout
        while len(data) < 8:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.replies], [], [], wait)[0]:
                return None
            chunk = os.read(self.replies, 8 - len(data))
            if not chunk:
                raise RuntimeError("the fork server died")
            data += chunk
        return struct.unpack("q", data)[0]

    def run(self, runs, cwd, timeout):
        # runs: [(args, env)], started together; their CompletedProcesses, in order. When one fails, the others
        # are killed, as torchrun stops the workers left when one of them fails.
        outs = [(tempfile.NamedTemporaryFile(), tempfile.NamedTemporaryFile()) for _ in runs]
        pids = self.fork([(args, env, out.name, err.name) for (args, env), (out, err) in zip(runs, outs)], cwd)
        statuses, deadline = {}, None if timeout is None else time.monotonic() + timeout
        while len(statuses) < len(pids):
            pid = self.read_reply(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if pid is None:  # as subprocess.run does on a timeout: kill, then raise
                self.kill(set(pids) - set(statuses))
                while len(statuses) < len(pids):
                    statuses[self.read_reply()] = self.read_reply()
                for out, err in outs:
                    out.close(), err.close()
                raise subprocess.TimeoutExpired(runs[0][0], timeout)
            statuses[pid] = self.read_reply()
            if statuses[pid]:
                self.kill(set(pids) - set(statuses))
        done = []
        for (args, _), (out, err), pid in zip(runs, outs, pids):
            stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
            out.close(), err.close()
            code = os.waitstatus_to_exitcode(statuses[pid])
            done.append(subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr))
        return done

    def fork(self, runs, cwd):
        # runs: [(args, env, stdout's path, stderr's path)], forked at once: their pids
        if self.started is not None:  # left running by a test that failed before it waited for it: ended
            self.started.end()          # here, so that the tests after it do not fail too
        requests = [dict(path=os.path.abspath(os.path.join(cwd, args[0])), argv=[str(a) for a in args],
                         cwd=str(cwd), env=dict(env), out=out, err=err) for args, env, out, err in runs]
        request = pickle.dumps(requests)
        self.proc.stdin.write(struct.pack("q", len(request)) + request)
        self.proc.stdin.flush()
        pids = [self.read_reply() for _ in runs]
        for (_, env, _, _), pid in zip(runs, pids):  # a child's /proc environ is the server's, without the mark
            if env.get(MARK):
                sessions.setdefault(env[MARK], set()).add(pid)
        return pids

    @staticmethod
    def kill(pids):
        for pid in pids:  # each child leads a session of its own, with whatever it started
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()
        os.close(self.replies)
        self.log.close()


_servers = {}  # one per set of values of FIXED that the runs asked for
# {mark: the sessions its children lead}: processes.py finds the processes of a test's forked runs by these
sessions = {}


def run(args, cwd, env, timeout=None):
    """subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout),
    in a child of a fork server that has the same values of FIXED."""
    return run_together([(args, env)], cwd, timeout)[0]


def interpreted(env):
    return env.get("TRITON_INTERPRET") == "1"


def fixed(env):
    return (*(env.get(k) for k in FIXED), interpreted(env))


def server_for(env):
    # the server whose values of FIXED are env's, started if there is none yet
    server = _servers.get(fixed(env))
    if server is None or server.proc.poll() is not None:
        server = _servers[fixed(env)] = Server(env)
    return server


def run_together(runs, cwd, timeout=None):
    """run() of each (args, env) in runs, all started at once (they must agree on FIXED's values): their
    CompletedProcesses. When one fails, those still running are killed."""
    assert len({fixed(env) for _, env in runs}) == 1, "runs that differ in FIXED"
    server = server_for(runs[0][1])
    if not server.quiet:
        procs = [subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for args, env in runs]
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]
    return server.run(runs, cwd, timeout)


class Started:
    """A run started by start(), as subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True) returns one: its
    pid (which leads a session of its own), its output read as it is written, send_signal, poll, wait and
    communicate. Waited for before the server forks the next run: one left running (its test failed) is killed
    then."""

    def __init__(self, server, args, cwd, env):
        self.server, self.args, self.returncode = server, args, None
        self.out = tempfile.NamedTemporaryFile()
        self.pid = server.fork([(args, env, self.out.name, self.out.name)], cwd)[0]
        server.started = self
        self.reader = open(self.out.name, errors="replace")
        self.stdout = self.lines()

    def lines(self):
        # the output's lines as they are written (the child writes to a file, read here as it grows), to its end
        line = ""
        while True:
            line += self.reader.readline()
            if line.endswith("\n"):
                yield line
                line = ""
            elif self.poll() is None:
                time.sleep(0.02)
            elif not (more := self.reader.read()):
                break
            else:
                line += more
        if line:
            yield line

    def poll(self):
        return self.wait(0)

    def wait(self, timeout=None):
        if self.returncode is None:
            pid = self.server.read_reply(timeout)
            if pid is None:
                if timeout:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                return None
            self.returncode = os.waitstatus_to_exitcode(self.server.read_reply())
            self.server.started = None
        return self.returncode

    def communicate(self, timeout=None):
        self.wait(timeout)
        output = "".join(self.stdout)
        self.reader.close()
        self.out.close()
        return output, None

    def end(self):
        # SIGKILL it, with whatever it started, wait for it, and drop its output
        self.server.kill([self.pid])
        self.wait()
        self.reader.close()
        self.out.close()

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)


def start(args, cwd, env):
    """subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, stdout=PIPE, stderr=STDOUT, text=True,
    start_new_session=True), in a child of a fork server that has the same values of FIXED: a Started."""
    server = server_for(env)
    if not server.quiet:
        return subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Started(server, args, cwd, env)


def close():
    for server in _servers.values():
        server.close()
    _servers.clear()
