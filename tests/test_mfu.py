"""MFU: the GPUs' datasheet peaks told apart (parallel.py), and the FLOPs of a step in PaLM's convention and as
run (model.py), each labelled in train.py's log and metrics. And the GPU a process alone takes (parallel.py)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import TINY, run
from lib import parallel
from lib.metrics import attended_keys
from lib.parallel import gpu_peak, peak_flops
from model import GPT, GPTConfig


@pytest.mark.parametrize("name, sms, bf16, tf32", [
    ("NVIDIA H100 80GB HBM3", 132, 989e12, 494e12),  # SXM
    ("NVIDIA H100 PCIe", 114, 756e12, 378e12),
    ("NVIDIA H100", 114, 756e12, 378e12),  # a PCIe card by its SMs alone
    ("NVIDIA H100 NVL", 132, 835e12, 418e12),
    ("NVIDIA H200", 132, 989e12, 494e12),
    ("NVIDIA A100-SXM4-80GB", 108, 312e12, 156e12),
])
def test_the_datasheet_peak_tells_the_h100s_apart(name, sms, bf16, tf32):
    assert gpu_peak(name, sms, half=True) == bf16
    assert gpu_peak(name, sms, half=False) == tf32


def test_peak_flops_reads_the_name_and_sms_of_the_device(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 NVL", multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: props.name)
    assert peak_flops("cuda", torch.bfloat16) == 835e12
    assert peak_flops("cuda", torch.float32) == 418e12
    assert gpu_peak("NVIDIA Unknown", 80, True) is None and parallel.GPU_PEAKS["H200"][0] == 989e12


def test_attended_keys_count_each_document_causally():
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert attended_keys(docs).item() == (1 + 2 + 3) + (1 + 2 + 3 + 4 + 5) + 8 * 9 // 2


def test_flops_run_are_palms_with_attention_as_masked():
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    per_key = 12 * 2 * 4 * 8  # 12·L·H·Q a key
    assert model.flops_per_token() - model.flops_per_token(keys=16.5) == per_key * (32 - 16.5)  # causal
    assert model.flops_per_token(16) == model.flops_per_token(keys=16)


def short_documents(folder):
    # documents of 8 tokens (end-of-text, id 0, before each), so that every window of 32 holds several: what
    # doc_mask runs is then always less than causal attention, whatever text the shared data would have had
    folder.mkdir()
    ids = np.random.default_rng(0).integers(1, 62, 20_000).astype(np.uint16)
    ids[::8] = 0
    ids[:18_000].tofile(folder / "train.bin")
    ids[18_000:].tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 62, "eot_id": 0}))
    return folder


@pytest.mark.parametrize("doc_mask", [False, True])
def test_train_logs_mfu_in_both_conventions(tmp_path, doc_mask):
    out_dir = tmp_path / "out"
    out = run(*TINY, f"--data_dir={short_documents(tmp_path / 'data')}", f"--out_dir={out_dir}", "--max_iters=3",
              "--eval_interval=100", f"--doc_mask={doc_mask}", "--gradient_accumulation_steps=2")
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r]
    assert len(steps) == 3 and " PaLM, " in out.stdout and "% run, mem" in out.stdout
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32))
    for r in steps:  # a step's tokens: 2 micro-steps of 4 sequences of 32
        assert r["tokens_per_s"] * r["ms_per_iter"] / 1000 == pytest.approx(2 * 4 * 32, rel=1e-9)
        ratio = r["mfu_run"] / r["mfu"]
        causal = model.flops_per_token(keys=33 / 2) / model.flops_per_token()
        assert ratio < causal if doc_mask else ratio == pytest.approx(causal, rel=1e-9)


@pytest.mark.parametrize("device, chosen", [("cuda", []), ("cuda:1", ["cuda:1"])])
def test_one_process_on_cuda_sets_its_gpu_only_when_named(monkeypatch, device, chosen):
    # torch.cuda.set_device refuses 'cuda' without an index (a ValueError: every train.py alone on a GPU failed so
    # on an H100): one process on 'cuda' keeps the current GPU, one on 'cuda:N' sets it
    seen = []

    def set_device(d):
        if torch.device(d).index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{d}")
        seen.append(d)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # which it sets
    try:
        processes = parallel.init_distributed(device, "auto", "auto", 1, False, False, 60)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert seen == chosen
    assert (processes.device, processes.dtype, processes.mesh) == (device, "bfloat16", None)


def test_each_process_under_torchrun_takes_its_nodes_gpu_of_its_local_rank(monkeypatch):
    # rank 3 of 4 (two nodes of 2 GPUs) takes its node's GPU 1, whether 'cuda' or another 'cuda:N' was given
    seen = []

    class Joining(Exception):  # where the process would join the group: far enough
        pass

    def rendezvous(*args, **kwargs):
        raise Joining
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", seen.append)
    monkeypatch.setattr(parallel.dist, "is_backend_available", lambda backend: True)
    monkeypatch.setattr(parallel.dist, "rendezvous", rendezvous)
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # which it sets
    try:
        for device in ("cuda", "cuda:0"):
            with pytest.raises(Joining):
                parallel.init_distributed(device, "auto", "auto", 1, False, False, 60)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    assert seen == ["cuda:1", "cuda:1"]
