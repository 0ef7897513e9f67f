"""The house's layout: what stands at the root, and the one direction imports run (read from the sources with ast,
nothing imported)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a user runs, and the three files the design names at the root beside them
SCRIPTS = {"train", "prepare", "sample", "eval", "export", "bench", "plot"}
ROOT_FILES = SCRIPTS | {"model", "kernels", "configurator"}
LIB = {p.stem for p in (ROOT / "lib").glob("*.py")} - {"__init__"}
# what serves only measurement, beside bench.py: bench.py and the tests may import it, the product never
BENCHMARKS = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {"__init__"}


def project_imports(path):
    # the project's modules a file imports, anywhere in it: 'lib.X' for the library's, 'benchmarks.X' for
    # measurement's, else the root module's name
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            package = node.module in ("lib", "benchmarks")
            names = [f"{node.module}.{a.name}" for a in node.names] if package else [node.module]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in ROOT_FILES or (n.startswith("lib.") and n[4:] in LIB)
                  or n.split(".")[0] == "benchmarks"}
    return found


def test_the_root_holds_the_scripts_and_the_named_files_only():
    assert {p.stem for p in ROOT.glob("*.py")} == ROOT_FILES
    assert LIB and not LIB & ROOT_FILES
    assert BENCHMARKS and not BENCHMARKS & (ROOT_FILES | LIB)


def test_imports_run_one_way():
    # scripts -> lib -> model -> kernels -> torch; configurator (train.py's overrides, which bench.py applies
    # too) imports nothing of the project's, not even lib.files: it stops with its own one line (sys.exit)
    assert project_imports(ROOT / "kernels.py") == set()
    assert project_imports(ROOT / "model.py") == {"kernels"}
    assert project_imports(ROOT / "configurator.py") == set()
    for name in LIB:
        wrong = {n for n in project_imports(ROOT / "lib" / f"{name}.py") if n.split(".")[0] in SCRIPTS}
        assert not wrong, f"lib/{name}.py imports the script(s) {sorted(wrong)}"
    for name in SCRIPTS:
        wrong = {n for n in project_imports(ROOT / f"{name}.py") if n.split(".")[0] in SCRIPTS}
        assert not wrong, f"{name}.py imports the script(s) {sorted(wrong)}"
    # measurement sits beside the product: it may import the library, the model and the kernels, never a script
    for name in BENCHMARKS:
        wrong = {n for n in project_imports(ROOT / "benchmarks" / f"{name}.py") if n.split(".")[0] in SCRIPTS}
        assert not wrong, f"benchmarks/{name}.py imports the script(s) {sorted(wrong)}"


def test_the_product_never_imports_measurement():
    # bench.py is measurement's one door: the other scripts, the named root files and the library leave the
    # benchmarks folder out, so a user reads and edits the trainer without it
    product = [ROOT / f"{name}.py" for name in ROOT_FILES - {"bench"}]
    product += [ROOT / "lib" / f"{name}.py" for name in LIB | {"__init__"}]
    for path in product:
        wrong = {n for n in project_imports(path) if n.split(".")[0] == "benchmarks"}
        assert not wrong, f"{path.relative_to(ROOT)} imports measurement's {sorted(wrong)}"
    assert any(n.startswith("benchmarks") for n in project_imports(ROOT / "bench.py"))


def test_a_run_of_one_process_never_imports_torchs_layouts():
    # torch.distributed.tensor and .checkpoint (sympy with them) cost ~1.5 s at every start: what train.py and
    # sample.py import at their top leaves them to where shards are (FSDP, tensor parallel, sharded checkpoints),
    # and parallel.is_dtensor tells a shard without them. A new Python: the tests' own process has imported
    # everything by now (their runs of the scripts are in process).
    import subprocess
    import sys
    scripts = [ast.parse((ROOT / f"{name}.py").read_text()) for name in ("train", "sample")]
    modules = sorted({n for tree in scripts for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                      for n in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module])
                      if n and (n.split(".")[0] in ROOT_FILES or n.startswith("lib."))})
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch.distributed.tensor', "
            "'torch.distributed.checkpoint', 'torch.distributed.fsdp'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "lib.trained" in modules and done.stdout.strip() == "[]", done.stdout  # (lib.trained: lib.checkpoint)


def test_no_module_over_600_lines_and_no_function_over_60():
    # the house's sizes (the project's code: the root's files and the library's; a function's lines from its def
    # to its last statement, docstring included)
    for path in [*ROOT.glob("*.py"), *(ROOT / "lib").glob("*.py")]:
        text = path.read_text()
        assert len(text.splitlines()) <= 600, f"{path.name}: {len(text.splitlines())} lines"
        long = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(text))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
        assert not long, f"{path.name}: functions over 60 lines {long}"
