from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```\n{command}\n```" in (ROOT / "README.md").read_text()
    assert command.endswith("python -m pytest -q -n auto tests")
    # and the quick tier, named beside it: the same command, less the tests marked slow
    assert 'python -m pytest -q -n auto tests -m "not slow"' in (ROOT / "README.md").read_text()


def test_readme_quick_start_names_real_files():
    readme = (ROOT / "README.md").read_text()
    for path in ("config/train_small.py", "config/train_shakespeare_char.py", "config/train_gpt2.py",
                 "requirements.txt", "requirements-dev.txt"):
        assert path in readme and (ROOT / path).exists(), path
