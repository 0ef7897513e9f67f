"""The house's layout: what stands at the root, and the one direction imports run (read from the sources with ast,
nothing imported)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# what a user runs, and the three files the design names at the root beside them
SCRIPTS = {"train", "prepare", "sample", "eval", "export", "bench"}
ROOT_FILES = SCRIPTS | {"model", "kernels", "configurator"}
LIB = {p.stem for p in (ROOT / "lib").glob("*.py")} - {"__init__"}


def project_imports(path):
    # the project's modules a file imports, anywhere in it: 'lib.X' for the library's, else the root module's name
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"lib.{a.name}" for a in node.names] if node.module == "lib" else [node.module]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in ROOT_FILES or (n.startswith("lib.") and n[4:] in LIB)}
    return found


def test_the_root_holds_the_scripts_and_the_named_files_only():
    assert {p.stem for p in ROOT.glob("*.py")} == ROOT_FILES
    assert LIB and not LIB & ROOT_FILES


def test_imports_run_one_way():
    # scripts -> lib -> model -> kernels -> torch; configurator (train.py's overrides, which bench's planning
    # applies too) needs only lib.errors
    assert project_imports(ROOT / "kernels.py") == set()
    assert project_imports(ROOT / "model.py") == {"kernels"}
    assert project_imports(ROOT / "configurator.py") == {"lib.errors"}
    for name in LIB:
        wrong = {n for n in project_imports(ROOT / "lib" / f"{name}.py") if n.split(".")[0] in SCRIPTS}
        assert not wrong, f"lib/{name}.py imports the script(s) {sorted(wrong)}"
    for name in SCRIPTS:
        wrong = {n for n in project_imports(ROOT / f"{name}.py") if n.split(".")[0] in SCRIPTS}
        assert not wrong, f"{name}.py imports the script(s) {sorted(wrong)}"
