"""Run a script of the project (train.py) in a new process, without paying for `import torch` each time.

A new Python spends ~3 s of CPU importing torch and its distributed packages before train.py reads its first
argument, and the tests start train.py a few hundred times. So, as multiprocessing's forkserver does, one
server process per pytest process imports those libraries once and forks a child for each run. The child is
a new process as before: its own pid and session, default signal handlers, its own standard streams,
environment and working folder, and whatever the script or a config file patches dies with it. It only finds
torch already imported. The server never imports the project's own modules, so each child reads them from
disk as a new Python would. A run whose environment the server cannot honour (see `FIXED`) starts a new
Python as before, and so does every run if importing the libraries printed anything (a child would not
print it again).

    done = run(["train.py", "--max_iters=2"], cwd=ROOT, env=env, timeout=300)  # a CompletedProcess
"""

import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time

# What train.py and kernels.py import from outside the project; triton only where the tests run it under its
# interpreter (TRITON_INTERPRET must be set before triton is imported).
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "torch.distributed.device_mesh", "torch.distributed.fsdp",
           "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.nn.parallel",
           "torch.utils.checkpoint"]
# read when Python starts, a library is imported or a thread pool starts: a child keeps the server's values
FIXED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TRITON_INTERPRET", "PYTHONHASHSEED",
         "PYTHONPATH", "PYTHONWARNINGS", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "PYTHONIOENCODING",
         "LD_PRELOAD", "LD_LIBRARY_PATH")
# the variable by which conftest.py finds the processes a test started: the server, shared, must not carry it
MARK = "PYTEST_PROCESS_MARK"

SERVER = r'''
import atexit, importlib, os, pickle, random, runpy, struct, sys, tempfile, threading
for name in sys.argv[1:]:
    importlib.import_module(name)
replies = int(os.environ.pop("FORKSERVER_REPLIES"))


def read(n):
    data = sys.stdin.buffer.read(n)
    if len(data) < n:
        os._exit(0)  # the pytest process is gone: so is the server
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
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["out"], os.O_WRONLY),
                            (2, request["err"], os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    random.seed()  # a new Python draws its seeds afresh; forked children would all share the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None  # TMPDIR is the child's
    sys.argv = request["argv"]
    sys.path[0] = os.path.dirname(request["path"])
    code = 0
    try:
        runpy.run_path(request["path"], run_name="__main__")
    except SystemExit as e:  # as the interpreter reads sys.exit's argument
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter does: a script may have installed its own
        code = 1
    try:  # then what the interpreter does on its way out: join the threads left running, run atexit's functions
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


reply(0)  # ready
while True:
    request = pickle.loads(read(struct.unpack("q", read(8))[0]))
    pid = os.fork()
    if pid == 0:
        child(request)
    reply(pid)
    reply(os.waitpid(pid, 0)[1])
'''


class Server:
    def __init__(self):
        replies_read, replies_write = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != MARK}
        env.update(OMP_NUM_THREADS="1", FORKSERVER_REPLIES=str(replies_write))
        self.env = env
        preload = [*PRELOAD, *(["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *preload], stdin=subprocess.PIPE, env=env,
                                     stdout=self.log, stderr=self.log, pass_fds=[replies_write], cwd="/",
                                     start_new_session=True)
        os.close(replies_write)
        self.replies = replies_read
        self.read_reply()
        self.log.seek(0)
        self.quiet = not self.log.read()  # the imports printed nothing that a child would not print again

    def serves(self, env):
        return self.quiet and all(env.get(k) == self.env.get(k) for k in FIXED)

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

    def run(self, args, cwd, env, timeout):
        with tempfile.NamedTemporaryFile() as out, tempfile.NamedTemporaryFile() as err:
            path = os.path.abspath(os.path.join(cwd, args[0]))
            request = pickle.dumps(dict(path=path, argv=[str(a) for a in args], cwd=str(cwd), env=dict(env),
                                        out=out.name, err=err.name))
            self.proc.stdin.write(struct.pack("q", len(request)) + request)
            self.proc.stdin.flush()
            pid = self.read_reply()
            status = self.read_reply(timeout)
            if status is None:  # as subprocess.run does on a timeout: kill, then raise
                os.killpg(pid, signal.SIGKILL)
                self.read_reply()
                raise subprocess.TimeoutExpired(args, timeout)
            stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess([sys.executable, *args], code, stdout, stderr)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()
        os.close(self.replies)
        self.log.close()


_server = None


def run(args, cwd, env, timeout=None):
    """subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout),
    in a child of the fork server where it can be."""
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = Server()
    if not _server.serves(env):
        return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
    return _server.run(args, cwd, env, timeout)


def close():
    global _server
    if _server is not None:
        _server.close()
        _server = None
