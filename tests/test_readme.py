import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # a Markdown link's target, less its #anchor


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


def test_readme_links_into_docs_reach_real_pages():
    # the README is a page that points into docs/: every relative link there, and in the docs' pages, is a file
    readme = (ROOT / "README.md").read_text()
    linked = {m for m in LINK.findall(readme) if "://" not in m}
    assert any(link.startswith("docs/") and link.endswith(".md") for link in linked), linked
    for link in sorted(linked):
        assert (ROOT / link).exists(), link
    for page in sorted(ROOT.glob("docs/*.md")):
        for link in LINK.findall(page.read_text()):
            if "://" not in link:
                assert (page.parent / link).exists(), f"{page.name}: {link}"
