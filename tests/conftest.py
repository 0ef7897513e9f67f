import contextlib
import getpass
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import pytest

# the tests import the project's modules (model, kernels, ...) from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The tests start some two hundred Pythons, each importing torch and more. They keep the bytecode they compile
# (__pycache__, in the venv and here) even where the environment says not to (PYTHONDONTWRITEBYTECODE), so that a
# module is compiled once, by its first importer. The install compiles nothing (pip --no-compile): all of the venv,
# 18,000 files, took 27 s on 2 cores, more than the tests' share of it. torch, which every process imports, is
# compiled first, on every core (compile_torch).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def compile_torch():
    # once, before any test process starts (5 s on 2 cores): the first quick tier of a new venv took 54-62 s
    # without, the first processes each compiling torch at once, and 52 s with
    import compileall
    import importlib.util
    folder = importlib.util.find_spec("torch").submodule_search_locations[0]
    if not os.path.exists(importlib.util.cache_from_source(os.path.join(folder, "__init__.py"))):
        compileall.compile_dir(folder, quiet=2, workers=0)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the quick tier (-m \"not slow\"): torchrun, compile, "
                            "Triton's interpreter at length, kill tests, big tokenizers")
    config.addinivalue_line("markers", "kills: kills or restarts processes; runs inside process tracking "
                            "(conftest.own_processes), so that none outlives the test")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (tests/test_cuda.py; -m cuda runs them alone), "
                            "skipped without one")
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        compile_torch()
    if config.getoption("dist", "no") != "no" and not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # pytest-xdist's controller runs no test: its workers start ~3 s sooner without torch imported here
    import torch
    from helpers import TIKTOKEN_CACHE

    # Without a GPU, Triton kernels can only run on CPU tensors under Triton's interpreter, which must be switched
    # on before anything imports triton (the test modules, collected next). With one, the kernels run compiled
    # (the CUDA tier, test_cuda.py, needs them so), and an in-process test that needs the interpreter skips.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under pytest-xdist each worker is one of several processes on few cores: torch's default of one thread per
    # core oversubscribes them, and the in-process tests' small ops wait on each other's threads (a tiny model's
    # training steps took 4-6 times the wall time and 3.5 times the CPU time with 2 threads on 2 loaded cores).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    # The tests never download: tiktoken reads the encodings from this team's shared cache where it is there.
    if TIKTOKEN_CACHE.is_dir():
        os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # A pytest-xdist worker has sent all its results by now: it ends here, without tearing down the modules it
    # imported (torch's, Triton's: ~2 s of CPU, which the controller would wait for).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@pytest.fixture(scope="session", autouse=True)
def torchrun_logs(tmp_path_factory):
    # torchrun keeps its workers' error files in a /tmp/torchelastic_* folder of its own each launch, and never
    # removes it: the tests' launches (each a torchrun's or lib.launch's) keep them in pytest's temporary folders
    os.environ["PET_LOG_DIR"] = str(tmp_path_factory.mktemp("torchrun_logs"))  # torchrun's --log-dir


@pytest.fixture(scope="session")
def data_dir(shared):
    # a tiny character-level dataset for the train.py tests, written here (nothing is downloaded):
    # characters of tinyshakespeare when it is there, else generated text of as many characters
    # (62), so that no test depends on which of the two it got; 90/10 split. One for the session (read only).
    return shared("data", write_data)


def write_data(d):
    from helpers import SHAKESPEARE
    text = SHAKESPEARE.read_text()[:200_000] if SHAKESPEARE.exists() else generated_text(200_000)
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    ids[:n].tofile(d / "train.bin")
    ids[n:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": len(chars), "eot_id": 0}))


def generated_text(n):
    # n characters of pseudo-English from a fixed seed, over exactly the 62 characters of the first
    # 200,000 of tinyshakespeare: words of lower-case letters, some capitalised, some punctuation
    chars = "\n !&',-.:;?ABCDEFGHIJKLMNOPQRSTUVWYZabcdefghijklmnopqrstuvwxyz"
    lower = [c for c in chars if c.islower()]
    marks = [c for c in chars if not c.isalpha() and c != " "]
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(lower, size=rng.integers(1, 8))) for _ in range(500)]
    out, size = [], 0
    while size < n:
        word = words[rng.integers(len(words))]
        if rng.random() < 0.15 and word[0] != "x":  # tinyshakespeare has no X
            word = word.capitalize()
        word += rng.choice(marks) if rng.random() < 0.1 else " "
        out.append(word)
        size += len(word)
    text = "".join(out)[:n - len(chars)]
    return text + chars  # every character at least once, whatever the draws


# -----------------------------------------------------------------------------
# The tests that kill or restart processes (marked `kills`) run inside process tracking: none of their processes
# may outlive them, and torchrun's scratch folders stay with the test's files. The other tests run scripts in their
# own process, or start processes with subprocess.run, which waits for them. Tracking reads Linux's /proc: elsewhere
# the tests run without it.

_marks = iter(range(10**9))


@contextlib.contextmanager
def own_processes(name, tmp_path_factory):
    # Every process started inside inherits a mark of its own (helpers.marked finds them by it, wherever they were
    # reparented) and a TMPDIR of its own: torchrun makes its torchelastic_* folders there. Compiled code keeps
    # its cache where it was (under the old TMPDIR), shared by the tests as before. None may outlive the block.
    from helpers import MARK, kill_marked, wait_unmarked
    mark = f"{os.getpid()}-{next(_marks)}"
    scratch = tmp_path_factory.mktemp(re.sub(r"\W", "_", name)[:40] + "-scratch")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
                   os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser()))
        env.setenv("TMPDIR", str(scratch))
        env.setenv(MARK, mark)
        yield
    left = wait_unmarked(mark, timeout=10)
    if left:
        kill_marked(mark)
        pytest.fail(f"{name} left {len(left)} process(es) running: {left}")


@pytest.fixture(autouse=True)
def processes_end_with_their_test(request, tmp_path_factory):
    if request.node.get_closest_marker("kills") and os.path.isdir("/proc"):
        with own_processes(request.node.name, tmp_path_factory):
            yield
    else:
        yield


# -----------------------------------------------------------------------------
# a run only read by several tests is made once per test session, whichever pytest-xdist worker needs it first


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """shared(name, build) -> a folder that build(folder) filled, once for the whole session: under pytest-xdist
    the workers' temporary folders have a common parent, and the first worker to ask builds while the others
    wait on a lock. Tests only read what is in it (copy before changing anything)."""
    from filelock import FileLock
    root = shared_root(tmp_path_factory)

    def get(name, build):
        folder = root / f"shared-{name}"
        with FileLock(f"{folder}.lock"):
            if not (root / f"shared-{name}.done").exists():
                if folder.exists():
                    shutil.rmtree(folder)  # a build that failed part way
                folder.mkdir()
                build(folder)
                (root / f"shared-{name}.done").touch()
        return folder
    return get


def shared_root(tmp_path_factory):
    # the folder all of the session's workers share: their temporary folders' parent under pytest-xdist
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
