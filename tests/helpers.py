"""What the test modules share: running train.py and the project's other scripts (in the test's own process, under
torchrun, or in a new Python), train.py's refusals found in process, reading a run's losses and weights,
counting Triton kernel launches, a free port, and where this team's shared files are.
Fixtures live in conftest.py; this is plain functions and names, imported as `from helpers import run, TINY`.
"""

import atexit
import contextlib
import io
import json
import os
import random
import re
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch

from lib.files import UserError

# The environment of the processes the CPU tests start (train.py and the other scripts, with --device=cpu), on a
# machine with a GPU too: the GPU hidden, so that nothing in them reaches for it, and Triton's interpreter only
# where a test asks for it (env={"TRITON_INTERPRET": "1"}, to run the fused ops on CPU): switched on for all,
# every run would pay for it. Without a GPU the interpreter is on for all (conftest.py), and the runs inherit it.
CPU_ENV = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

# What only this team's machines have sits in ../shared beside the checkout; a user's clone has none of
# it, and every test either works without it or skips with the reason. The project's own code never
# looks there: conftest.py points tiktoken at the shared cache of its encodings (it downloads them
# otherwise), and the training tests' dataset reads tinyshakespeare when it is there.
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
TIKTOKEN_CACHE = SHARED / "tiktoken_cache"
needs_tiktoken = pytest.mark.skipif(not TIKTOKEN_CACHE.is_dir(), reason=f"no tiktoken cache at {TIKTOKEN_CACHE} "
                                    "(tests never download)")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4",
        "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=20", "--learning_rate=1e-2"]


# The tests' runs are CPU runs, on a machine with a GPU too: without --device, train.py, sample.py and eval.py
# would pick the GPU there (and bf16, and the kernels), and torchrun's processes one GPU each; and the GPU is
# hidden from them (CPU_ENV above). Their Triton kernels, where a test asks for them (and for the
# interpreter), run under the interpreter on CPU as they do without a GPU.
ON_CPU = ("train.py", "sample.py", "eval.py")


def on_cpu(args):
    args = [str(a) for a in args]
    return args if any(a.startswith("--device=") for a in args) else [*args, "--device=cpu"]


# The distributed tests' standard run: 8 updates of 8 sequences of the tiny model (2 a micro-step, 4 micro-steps),
# evaluated (and saved) every 2 steps. Made once per session (conftest.py's shared fixture) in one process and
# under DDP on 2 processes, keeping the last two checkpoints; tests that compare another layout with it only read
# them (test_train, test_parallel, test_scale). The DDP run's stdout is kept beside it in stdout.txt.
STANDARD = [*TINY, "--batch_size=2", "--gradient_accumulation_steps=4", "--eval_interval=2", "--max_iters=8",
            "--keep_last_n=2"]


def train_settings(args):
    # train.py's settings after args, its config files and --key=value overrides, as configurator.py applies them
    from configurator import configure
    from lib.settings import defaults
    settings = defaults()
    configure(settings, [str(a) for a in args])
    return settings


def train_refusal(*args):
    # the one line train.py stops with for args: train.py itself, in this process (run), into a new out_dir (removed
    # after) unless args name one; the line is the last its one-line hook printed
    with tempfile.TemporaryDirectory(prefix="refused-") as out:
        if not any(str(a).startswith("--out_dir=") for a in args):
            args = [*args, f"--out_dir={out}"]
        done = run(*args, check=False)
    said = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode != 0, f"train.py did not refuse {args}:\n{done.stdout[-2000:]}"
    return said.removeprefix("train.py: ")


def standard_run(shared, data_dir, layout):
    # layout: "one" (one process) or "ddp" (torchrun, 2 processes); the run's out_dir, read only
    def build(out):
        torchrun = ["--standalone", "--nproc_per_node=2"] if layout == "ddp" else ()
        done = run(*STANDARD, f"--data_dir={data_dir}", f"--out_dir={out}", torchrun=torchrun)
        (out / "stdout.txt").write_text(done.stdout)
    return shared(f"standard_{layout}", build)


# The FSDP tests' exact run: 9 updates under FSDP on 2 processes, with dropout, saved every 3 steps, the three
# checkpoints kept. Made once per session, like the standard runs; test_scale resumes it, test_fault_tolerance kills
# it on two nodes.
EXACT = [*TINY, "--batch_size=2", "--gradient_accumulation_steps=4", "--dropout=0.1", "--eval_interval=3",
         "--max_iters=9", "--fsdp=True"]


def exact_fsdp_run(shared, data_dir):
    return shared("fsdp_run", lambda out: run(*EXACT, f"--data_dir={data_dir}", f"--out_dir={out}", "--keep_last_n=3",
                                              torchrun=["--standalone", "--nproc_per_node=2"]))


class HeadersOnly:
    """safetensors.safe_open where a tensor's values cannot be read (get_tensor), only the file's header: the names,
    shapes and dtypes of its tensors."""
    opened = staticmethod(__import__("safetensors").safe_open)

    def __init__(self, *args, **kwargs):
        self.file = HeadersOnly.opened(*args, **kwargs)

    def __enter__(self):
        self.file.__enter__()
        return self

    def __exit__(self, *error):
        return self.file.__exit__(*error)

    def keys(self):
        return self.file.keys()

    def get_slice(self, name):  # (its shape and dtype)
        return self.file.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError(f"{name}'s values were read")


def master_reads(path):
    # a config file (path) under which processes other than torchrun's rank 0 cannot read a safetensors file's
    # tensors (HeadersOnly): a Hugging Face folder's weights are the master's to read -> its path, for train.py
    path.write_text(f"import os as _os, sys as _sys\n_sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "if _os.environ.get('RANK', '0') != '0':\n    import safetensors as _st\n"
                    "    from helpers import HeadersOnly as _HeadersOnly\n    _st.safe_open = _HeadersOnly\n")
    return str(path)


def poisoned_config(path, body):
    # a config file (Python, as config files are) at path that breaks training as a bug or a bad setting would:
    # body, run as the file is read, may wrap _loss (model.linear_cross_entropy, each real training step's
    # loss) or _step (AdamW.step), counting real steps in _calls[0] from 1 (_is_fake: the memory estimate's trace
    # on fake tensors is no training step)
    path.write_text(
        "import torch as _torch\n"
        "import model as _m\n"
        "from torch._subclasses.fake_tensor import is_fake as _is_fake\n"
        "_loss, _step, _calls = _m.linear_cross_entropy, _torch.optim.AdamW.step, [0]\n"
        + body)
    return str(path)


def run(*args, torchrun=(), check=True, env=None):
    # train.py as a user runs it: in one process, here in the test's own (in_process: a new Python would spend ~3 s
    # of CPU importing torch before its first step); with torchrun's arguments, under torchrun itself, its workers
    # new Pythons (torchrun_run)
    args, interpret = on_cpu(args), os.environ.get("TRITON_INTERPRET")
    if torchrun:
        done = torchrun_run([*torchrun, "train.py", *args], {**os.environ, **CPU_ENV, **(env or {})})
    elif (env or {}).get("TRITON_INTERPRET", interpret) != interpret:  # Triton's interpreter is on or off as Triton
        done = new_python("train.py", *args, env=env)  # is imported: here it was without (a GPU machine)
    else:
        done = in_process("train.py", args, env={**CPU_ENV, **(env or {})})
    if check and done.returncode != 0:
        raise AssertionError(f"train.py failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done


def torchrun_command(args):
    # the command line of `torchrun ARGS`
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def torchrun_run(args, env, timeout=300):
    # `torchrun ARGS` run to its end from the project's folder -> a CompletedProcess (torchrun_together's)
    return torchrun_together([args], env, timeout)[0]


def torchrun_together(launches, env, timeout=300):
    # several `torchrun ARGS` at once (launches: [ARGS, ...]), as the nodes of one run: each in a session of its
    # own, its output in files (no pipe to fill). When time runs out, or 10 s after one failed (its peers fail on
    # their own meanwhile where they can), the others get SIGTERM, which torchrun passes to its workers and waits
    # for, and SIGKILL 30 s later -> their CompletedProcesses
    outputs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in launches]
    procs = [subprocess.Popen(torchrun_command(args), cwd=ROOT, env=env, stdout=out, stderr=err, text=True,
                              start_new_session=True) for args, (out, err) in zip(launches, outputs)]
    deadline, sent = time.time() + timeout, None
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs):
            deadline = min(deadline, time.time() + 10)
        now = time.time()
        if now > deadline and sent != (sig := signal.SIGTERM if now < deadline + 30 else signal.SIGKILL):
            for p in procs:  # once each: a second SIGTERM would break into torchrun's ending of its workers
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
            sent = sig
        time.sleep(0.05)
    done = []
    for args, p, (out, err) in zip(launches, procs, outputs):
        out.seek(0), err.seek(0)
        done.append(subprocess.CompletedProcess(torchrun_command(args), p.returncode, out.read(), err.read()))
        out.close(), err.close()
    return done


def two_nodes(*args, torchrun=(), node_args=((), ()), timeout=300):
    # train.py under torchrun as two nodes of one process each, meeting at a c10d rendezvous on this machine, as
    # users run them (torchrun_together: when one fails the other is ended). torchrun: more of torchrun's
    # arguments for both; node_args: train.py's arguments of one node only (a setting that differs between them).
    # Their CompletedProcesses.
    port, env = free_port(), {**os.environ, **CPU_ENV}
    nodes = [["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1", "--rdzv_backend=c10d",
              f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two_nodes", *torchrun,
              "train.py", *on_cpu([*args, *node_args[node]])] for node in (0, 1)]
    return torchrun_together(nodes, env, timeout)


def script(*args, cwd=ROOT, env=None):
    # another of the project's scripts (prepare.py, export.py, sample.py, eval.py, bench.py), in this process
    name = Path(str(args[0])).name
    return in_process(args[0], on_cpu(args[1:]) if name in ON_CPU else args[1:], cwd, {**CPU_ENV, **(env or {})})


def new_python(*args, cwd=ROOT, env=None, timeout=300):
    # `python SCRIPT ARGS` in a new Python, where the test is about the script's own process -> a CompletedProcess
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env={**os.environ, **CPU_ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def in_process(path, args, cwd=ROOT, env=None):
    # `python PATH ARGS` from cwd (PATH relative to the project's folder), run in this process as Python runs a
    # script (runpy, as __main__), with env's variables set meanwhile -> a CompletedProcess of its exit status, its
    # stdout, and its stderr: for a UserError what the script's own hook prints (files.one_line_errors), status 1.
    # Any other exception is a bug, and the test's: raised here. What a process's end does is done at the script's
    # end: the exit functions the project (and its config files) registered run (an out_dir's lock is let go), a
    # process group left is ended, and the signal handlers, warning filters and exception hook are put back; so are
    # the project's modules, which a config file may patch, and sys.path, and torch.compile's caches are dropped.
    out, err, name = io.StringIO(), io.StringIO(), Path(path).name
    project = {key: (module, dict(vars(module))) for key, module in list(sys.modules.items()) if ours(module)}
    import_path, modules = list(sys.path), dict(sys.modules)
    environ = dict(os.environ)  # put back whole: a library the script imports may set variables too
    hook, handlers = sys.excepthook, {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    at_exit, register = [], atexit.register

    def own_exits(fn, *a, **kw):  # a library's (imported for the first time by the script) stays the process's
        if "site-packages" in getattr(getattr(fn, "__code__", None), "co_filename", "site-packages"):
            return register(fn, *a, **kw)
        at_exit.append((fn, a, kw))
        return fn
    try:
        with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
            os.environ.update(env or {})
            patch.chdir(cwd)
            patch.setattr(sys, "argv", [name, *map(str, args)])
            patch.setattr(atexit, "register", own_exits)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    runpy.run_path(str(ROOT / path), run_name="__main__")
                    status = 0
                except UserError as e:
                    sys.excepthook(type(e), e, e.__traceback__)
                    status = 1
                except SystemExit as e:  # argparse's, or sys.exit(): a number, or a message and status 1
                    status = e.code if isinstance(e.code, int) or e.code is None else \
                        print(e.code, file=sys.stderr) or 1
                finally:
                    for fn, a, kw in reversed(at_exit):
                        fn(*a, **kw)
    finally:
        sys.excepthook = hook
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.path[:] = import_path
        run_modules = set()  # (ids)
        os.environ.clear()
        os.environ.update(environ)
        for key, module in list(sys.modules.items()):
            if module is None and modules.get(key) is not None:  # hidden by the run (a test without lm_eval): put
                sys.modules[key] = modules[key]  # back, or its submodules, still there, would be no attributes of it
            elif (ours(module) and key not in project) or (module is None and key not in modules):
                del sys.modules[key]  # imported by the run, or hidden by it: the next one imports it anew
                if module is not None:
                    run_modules.add(id(module))
        for module, namespace in project.values():  # names added meanwhile stay (Triton's interpreter adds some)
            vars(module).update((k, v) for k, v in namespace.items() if vars(module).get(k) is not v)
            for k in [k for k, v in vars(module).items() if k not in namespace and id(v) in run_modules]:
                delattr(module, k)  # a submodule the run imported (lib.checkpoint): `from lib import` would take it
        torch._dynamo.reset()
    return subprocess.CompletedProcess([name, *map(str, args)], status or 0, out.getvalue(), err.getvalue())


def ours(module):
    # a module of the project (or of its tests), not of a library installed inside its folder (.venv)
    file = str(getattr(module, "__file__", None) or "")
    return file.startswith(str(ROOT)) and "site-packages" not in file


def losses(out_dir, key="loss"):
    # the last loss (or another value of the steps' records; val_...: of the evaluations') recorded for each step (a
    # resumed run records the steps it repeats again)
    records = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["iter"]: r[key] for r in records if ("val_loss" in r) == key.startswith("val_")}


def weights(out_dir, name="ckpt.pt"):
    return torch.load(Path(out_dir) / name, weights_only=True)["model"]


def assert_weights_close(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


# A config file for train.py that counts the launches of each Triton kernel in kernels.py and prints them as the
# process exits. Equal losses alone cannot show that the fused ops ran: the plain ops give the same losses.
KERNEL_COUNTER = """
import atexit as _atexit, json as _json, sys as _sys
import kernels as _kernels


def _counted(name, kernel):
    class _Counted:  # kernel[grid](...) is how kernels.py launches one
        def __getitem__(self, grid):
            _launches[name] += 1
            return kernel[grid]
    return _Counted()


_launches = {_name: 0 for _name, _value in vars(_kernels).items()
             if _name.endswith("_kernel") and type(_value).__module__.startswith("triton")}
_kept = {_name: getattr(_kernels, _name) for _name in _launches}
for _name in _launches:
    setattr(_kernels, _name, _counted(_name, _kept[_name]))


def _report():  # one write of the whole line: torchrun's workers share the pipe, and print's pieces interleave
    for _name, _kernel in _kept.items():  # and kernels.py as it was, for a run in the test's own process
        setattr(_kernels, _name, _kernel)
    _sys.stdout.flush()
    _sys.stdout.write("TRITON LAUNCHES " + _json.dumps(_launches) + "\\n")
    _sys.stdout.flush()


_atexit.register(_report)
"""


def kernel_counter(folder):
    path = Path(folder) / "count_kernel_launches.py"
    path.write_text(KERNEL_COUNTER)
    return str(path)


def kernel_launches(stdout):
    # {kernel: launches} of each process that ran with kernel_counter's config
    counts = [json.loads(m) for m in re.findall(r"TRITON LAUNCHES (\{[^{}]*\})", stdout)]
    assert counts, "no process printed its kernel launches"
    for op in ("rms_norm", "swiglu", "rotary", "cross_entropy"):  # every fused op has its kernels counted
        assert all(any(op in name for name in count) for count in counts), (op, counts)
    return counts


def assert_every_kernel_ran(stdout):
    for count in kernel_launches(stdout):
        assert all(n > 0 for n in count.values()), count


def assert_no_kernel_ran(stdout):
    for count in kernel_launches(stdout):
        assert not any(count.values()), count


def free_port():
    # A port no other test takes meanwhile: below Linux's ephemeral range (32768-60999, where torchrun
    # --standalone and every client socket get theirs), in a range of its own for each pytest-xdist worker.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    start = 20000 + 1000 * (worker % 12)
    for port in random.sample(range(start, start + 1000), 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {start}-{start + 999}")


# The tests that kill or restart processes find every process they started by a mark in its environment, whoever
# its parent is now: conftest.py gives each such test its own value of MARK, and every process it starts inherits
# it, and so do the processes those start: torchrun's workers too, which outlive a killed launcher. /proc/PID/environ
# is the environment a process was started with, so the pytest process itself, which set the variable later, never
# matches.
MARK = "PYTEST_PROCESS_MARK"


def marked(value=None):
    # {pid: command line} of the live processes whose environment holds MARK=value (this test's by default)
    value = os.environ.get(MARK) if value is None else value
    if not value or not os.path.isdir("/proc"):  # conftest.py tracks processes only where /proc is
        return {}
    needle, found = f"{MARK}={value}".encode(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":  # exited, only not yet reaped
                    continue
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
    seen, deadline = dict(alive), time.time() + timeout
    while alive:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
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
