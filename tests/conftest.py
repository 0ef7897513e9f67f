import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

# the tests import the project's modules (model, kernels, ...) from the repository root
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels can only run on CPU tensors under Triton's interpreter, which
# must be switched on before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    # a tiny character-level dataset for the train.py tests, written here (nothing is downloaded):
    # characters of tinyshakespeare when it is there, else generated text; 90/10 split
    text = SHAKESPEARE.read_text()[:200_000] if SHAKESPEARE.exists() else "the quick brown fox. " * 10_000
    chars = sorted(set(text))
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    d = tmp_path_factory.mktemp("data")
    n = int(0.9 * len(ids))
    ids[:n].tofile(d / "train.bin")
    ids[n:].tofile(d / "val.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": len(chars), "eot_id": 0}))
    return d
