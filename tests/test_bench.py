"""bench.py --mode=gpu, the one command for everything a GPU must show, at tiny shapes on CPU (--tiny): every
section of its Markdown is there and holds numbers. Its timings are a CPU's and are not checked."""

import re

import pytest

from test_train import script

pytestmark = pytest.mark.slow  # ~15 runs of train.py

SECTIONS = ["### Fused kernels", "### GPT-2 124M training step", "### Memory estimate against the measured peak",
            "### AdamW against Muon", "### Fine-tuning"]


def rows(section):
    # a section's table rows, as lists of cells (header and rule left out)
    lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines[1:]]


def number(cell):
    return re.fullmatch(r"-?[\d,]+(\.\d+)?%?", cell) is not None


def test_gpu_mode_tiny_on_cpu_writes_every_section():
    # the kernels under Triton's interpreter would take minutes: their references stand in on CPU
    done = script("bench.py", "--mode=gpu", "--tiny", "--steps=3", "--warmup=1", env={"TRITON_INTERPRET": "0"},
                  timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    check_report(done.stdout)


def check_report(text):
    assert re.match(r"## \d{4}-\d\d-\d\d, GPU: CPU", text)
    assert re.search(r"torch \S+, Triton \S+, CUDA \S+, commit \w+", text)
    positions = [text.index(s) for s in SECTIONS]
    assert positions == sorted(positions)
    sections = dict(zip(SECTIONS, [text[a:b] for a, b in zip(positions, positions[1:] + [len(text)])]))
    kernels = rows(sections["### Fused kernels"])
    assert {r[0] for r in kernels} == {"rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy"}
    assert all(number(r[3]) and number(r[5]) for r in kernels)  # eager and fused ms (compiled: GPU only)
    steps = {r[0]: r for r in rows(sections["### GPT-2 124M training step"])}
    assert {"kernels off, eager", "kernels on, eager", "SDPA, causal"} <= steps.keys()
    assert any("doc_mask" in name for name in steps)
    assert all(len(r) == 5 and all(map(number, r[1:])) for r in steps.values())
    memory = rows(sections["### Memory estimate against the measured peak"])
    measured = [r for r in memory if not r[2].startswith("failed")]
    assert [r[1] for r in measured] == ["one process", "checkpointing"] and all(map(number, measured[0][2:]))
    assert "fsdp_cpu_offload=True" in sections["### Memory estimate against the measured peak"]  # CUDA only: a line
    optimizers = {r[0]: r for r in rows(sections["### AdamW against Muon"])}
    assert optimizers.keys() == {"adamw", "muon"} and all(map(number, optimizers["muon"][1:]))
    finetunes = {r[0]: r for r in rows(sections["### Fine-tuning"])}
    assert finetunes.keys() == {"full", "LoRA", "LoRA, int8 base", "QLoRA"}
    assert all(map(number, finetunes["full"][2:])) and all(map(number, finetunes["LoRA"][2:]))
