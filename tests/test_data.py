"""data.py's batches as train.py gets them: tensors ready to be pinned and copied to a GPU in one piece."""

import json

import numpy as np
import pytest

from data import Split


@pytest.mark.parametrize("kind", ["windows", "whole", "packed"])
def test_batches_are_contiguous(tmp_path, kind):
    # x = tokens[:, :-1] is a strided view: pinned as it is, its copy to a GPU goes a row at a time
    ids = np.random.default_rng(0).integers(1, 50, 5000).astype(np.uint16)
    ids[::37] = 0  # end-of-text: documents of 37 tokens
    ids.tofile(tmp_path / "train.bin")
    meta = {"dtype": "uint16", "vocab_size": 50, "eot_id": 0}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    split = Split(str(tmp_path), "train", meta, 64, seed=1, examples=kind == "packed", vocab_size=50)
    batch = {"windows": lambda: split.windows(0, 0, 4, doc_mask=True),
             "whole": lambda: split.whole(range(4), 16, doc_mask=True),
             "packed": lambda: split.packed(range(4))}[kind]()
    assert all(t.is_contiguous() for t in batch)
    assert batch[0].shape == batch[1].shape == batch[2].shape == (4, 64)
