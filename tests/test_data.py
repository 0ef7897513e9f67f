"""data.py's batches as train.py gets them: tensors ready to be pinned and copied to a GPU in one piece."""

import json
import os

import numpy as np
import pytest
import torch

from lib.data import Batches, Split
from lib.files import UserError, check_data_for_run


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


def shakespeare_like(tmp_path, n=5003, vocab=50):
    ids = np.random.default_rng(1).integers(1, vocab, n).astype(np.uint16)
    ids[::41] = 0
    ids.tofile(tmp_path / "train.bin")
    return {"dtype": "uint16", "vocab_size": vocab, "eot_id": 0}, ids


@pytest.mark.parametrize("block_size", [64, 100])
def test_an_epoch_of_windows_has_every_target_once_however_processes_and_micro_steps_share_it(tmp_path, block_size):
    # train.py's numbering: sequence (step * gradient_accumulation_steps + index) * batch_size + b, where index is
    # dp_rank * micro_steps + micro; two processes of three micro-steps each take the micro-batches of a step
    meta, ids = shakespeare_like(tmp_path)
    split = Split(str(tmp_path), "train", meta, block_size, seed=3, examples=False, vocab_size=50)
    batch_size, dp, micro_steps = 4, 2, 3
    per_epoch = split.sequences_in(1)
    assert split.sequences_in(2) - per_epoch in (per_epoch - 1, per_epoch, per_epoch + 1)
    seen = {0: np.zeros(len(ids), dtype=int), 1: np.zeros(len(ids), dtype=int)}
    for step in range(-(-split.sequences_in(2) // (batch_size * dp * micro_steps))):
        for rank in range(dp):
            for micro in range(micro_steps):
                first = (step * dp * micro_steps + rank * micro_steps + micro) * batch_size
                numbers = range(first, first + batch_size)
                x, y, _ = split.shuffled(numbers, doc_mask=False, limit=split.sequences_in(2))
                for n, row_x, row_y in zip(numbers, x.numpy(), y.numpy()):
                    if n >= split.sequences_in(2):
                        assert (row_y == -1).all()  # past the last epoch: padding
                        continue
                    start = split.sequence(n)
                    targets = np.flatnonzero(row_y != -1)
                    assert (row_y[targets] == ids[start + 1 + targets]).all()  # the tokens that follow
                    assert (row_x[targets] == ids[start + targets]).all()
                    seen[int(n >= per_epoch)][start + 1 + targets] += 1
    for epoch in (0, 1):  # every token but the first (no token before it to predict it from) once an epoch
        assert seen[epoch][0] == 0 and (seen[epoch][1:] == 1).all()
    starts = [[split.sequence(n) for n in range(split.sequences_in(e), split.sequences_in(e + 1))] for e in (0, 1)]
    assert starts[0] != starts[1]  # another order and another grid each epoch


def test_a_resume_deep_in_the_windows_draws_its_epoch_alone_in_the_order_runs_began_with(tmp_path):
    # A run resumed in epoch 5 reads its first batch having drawn that epoch's order only (the epochs before are
    # counted, not drawn; 10^11 tokens in windows of 256 are 1.6 GB an epoch), 4 bytes a window, and its windows are
    # those of the order runs always drew (rng.permutation's), so that a checkpoint written before resumes as it was
    meta, _ = shakespeare_like(tmp_path, n=100_003)
    split = Split(str(tmp_path), "train", meta, 16, seed=7, examples=False, vocab_size=50)
    first = split.sequences_in(5)
    assert split.epochs == {}  # counting five epochs drew none
    numbers = range(first + 3, first + 11)
    got = [split.sequence(n) for n in numbers]
    assert list(split.epochs) == [5] and split.epochs[5][1].itemsize == 4
    rng = np.random.default_rng([7, 5])
    offset = 1 + int(rng.integers(16))
    expected = offset - 16 + 16 * rng.permutation(1 + -(-(100_003 - 1 - offset) // 16))
    assert got == expected[3:11].tolist()
    split.sequence(split.sequences_in(6) + 2)  # into epoch 6: the one before kept (a step may straddle the two)
    assert sorted(split.epochs) == [5, 6]
    split.sequence(split.sequences_in(7))
    assert sorted(split.epochs) == [6, 7]


def test_shuffled_windows_are_a_pure_function_of_seed_and_number(tmp_path):
    meta, _ = shakespeare_like(tmp_path)
    a = Split(str(tmp_path), "train", meta, 64, seed=3, examples=False, vocab_size=50)
    b = Split(str(tmp_path), "train", meta, 64, seed=3, examples=False, vocab_size=50)
    later = range(a.sequences_in(3) + 5, a.sequences_in(3) + 9)  # a resumed run asks for epoch 3 first
    for x, y in zip(b.shuffled(later, doc_mask=True), [*a.shuffled(range(4), True), *a.shuffled(later, True)][3:]):
        assert x is y or x is None or torch.equal(x, y)
    other = Split(str(tmp_path), "train", meta, 64, seed=4, examples=False, vocab_size=50)
    assert not torch.equal(other.shuffled(range(8), False)[0], a.shuffled(range(8), False)[0])


@pytest.mark.parametrize("sequences", ["random", "windows", "examples"])
def test_an_evaluation_reads_the_same_sequences_whatever_the_micro_batch_and_processes(tmp_path, sequences):
    # batch_size='auto' may take another micro-batch than the batch_size given: an evaluation reads the same
    # eval_sequences of a split (12 here) in micro-batches of any size, the last part full, over any processes
    meta, ids = shakespeare_like(tmp_path)
    ids.tofile(tmp_path / "val.bin")

    def read(batch_size, replicas):  # x and y of every micro-batch of the evaluation, in train.py's order
        batches = Batches(str(tmp_path), meta, 64, 3, 50, sequences, batch_size, 12, len(ids), eval_sequences=12)
        shares = batches.evaluation_batches(replicas)
        splits = ("train", "val") if sequences == "random" else ("train",)  # (val scored whole otherwise)
        read = {split: [batches.evaluation(split, k * replicas + rank) for k in range(shares[split])
                        for rank in range(replicas)] for split in splits}
        for got in read.values():
            assert None not in got[:-replicas]  # only a last share may be short
        return {split: [torch.cat([b[i] for b in got if b is not None]) for i in (0, 1)] for split, got in read.items()}

    whole = read(12, 1)
    assert [len(x) for x, _ in whole.values()] == [12] * len(whole)
    for batch_size, replicas in ((5, 1), (4, 2), (5, 2), (7, 2)):
        for split, (x, y) in read(batch_size, replicas).items():
            assert torch.equal(x, whole[split][0]) and torch.equal(y, whole[split][1]), (split, batch_size, replicas)


def test_a_dataset_prepared_again_into_its_folder_leaves_a_run_reading_its_own(tmp_path):
    # prepare.py --overwrite renames new token files into place while a run trains on the old ones: the run
    # goes on with the tokens it began with (a resume then sees the data changed: start.py's fingerprint)
    meta, ids = shakespeare_like(tmp_path)
    split = Split(str(tmp_path), "train", meta, 64, seed=3, examples=False, vocab_size=50)
    before = split.shuffled(range(8), doc_mask=False)
    (ids[::-1] % 7).tofile(tmp_path / "new.bin")
    os.replace(tmp_path / "new.bin", tmp_path / "train.bin")
    assert all(torch.equal(a, b) for a, b in zip(before, split.shuffled(range(8), doc_mask=False)) if a is not None)
    assert Split(str(tmp_path), "train", meta, 64, 3, False, 50).tokens().max() == 6  # a new run reads the new


def test_the_data_is_checked_for_the_run(tmp_path):
    # train.py's checks of its data (files.check_data_for_run), in process: the model's vocabulary is the data's
    # padded to a multiple of 64, or refused below it; documents and examples need the end-of-text id; windows
    # need files longer than block_size, whole examples do not
    for split in ("train", "val"):
        (np.arange(100, dtype=np.uint16) % 70).tofile(tmp_path / f"{split}.bin")
    meta = {"dtype": "uint16", "vocab_size": 70}
    assert check_data_for_run(str(tmp_path), meta, 0, False, "windows", 32) == (128, 100)
    assert check_data_for_run(str(tmp_path), {**meta, "eot_id": 69}, 70, True, "examples", 500) == (70, 100)
    with pytest.raises(UserError, match="has 70 token ids but the model's vocab_size is 64 "):
        check_data_for_run(str(tmp_path), meta, 64, False, "windows", 32)
    for doc_mask, sequences in [(True, "windows"), (False, "examples")]:
        with pytest.raises(UserError, match=f"{'doc_mask=True' if doc_mask else 'sequences=examples'} needs the "
                                            "end-of-text id"):
            check_data_for_run(str(tmp_path), meta, 0, doc_mask, sequences, 32)
    with pytest.raises(UserError, match="has 100 tokens, too few for block_size=100"):
        check_data_for_run(str(tmp_path), meta, 0, False, "windows", 100)


def test_a_large_token_file_is_checked_in_chunks_spread_over_it_at_the_start_and_in_every_batch(tmp_path, monkeypatch):
    # a start reads SCANNED ids at most (10^11 tokens were 200 GB read by every process at every start): a bad id
    # between the chunks read is found by the batch that reads it, as is an id past the data's own vocab_size that
    # the model's padded one would take
    from lib import files
    monkeypatch.setattr(files, "SCANNED", 2000)
    ids = np.arange(10_000, dtype=np.uint16) % 50
    ids[1500] = 60  # in the second chunk of 1,000, which a start reading 2,000 of 10,000 ids skips
    ids.tofile(tmp_path / "train.bin")
    files.check_token_ids(str(tmp_path / "train.bin"), "uint16", 50, chunk=1000)
    ids[5500] = 60  # the sixth chunk, which it reads
    ids.tofile(tmp_path / "train.bin")
    with pytest.raises(UserError, match="holds token id 60 at position 5500, past meta.json's vocab_size 50"):
        files.check_token_ids(str(tmp_path / "train.bin"), "uint16", 50, chunk=1000)
    meta = {"dtype": "uint16", "vocab_size": 50, "eot_id": None}
    split = Split(str(tmp_path), "train", meta, 64, seed=0, examples=False, vocab_size=64)  # the model's: padded
    with pytest.raises(UserError, match="token id 60 at position 1500 of .*train.bin is not below 50, meta.json's "
                                        "vocab_size or the model's"):
        split.rows(np.array([1480]), np.zeros(1, dtype=np.int64), doc_mask=False)


@pytest.mark.parametrize("masked", [False, True])
def test_targets_and_documents_follow_the_tokens_and_the_mask(tmp_path, masked):
    # rows() (random, shuffled and whole windows alike: whole's here, at known starts) and packed examples: a target
    # is the next token where the mask trains it (1), no example's first token is one, and a document begins after
    # each end-of-text, one the mask marks END (2) where there is a mask: a template's own inside a conversation (0)
    # begins none, as in generate(document=)
    rng = np.random.default_rng(5)
    ids = rng.integers(1, 50, 3000).astype(np.uint16)
    ends = np.sort(rng.choice(np.arange(5, 2999), 300, replace=False))  # examples of ~10 tokens: ~3 a row
    ids[ends], ids[-1] = 0, 0
    meta, marks = {"dtype": "uint16", "vocab_size": 50, "eot_id": 0}, np.ones(len(ids), dtype=np.uint8)
    if masked:
        marks = rng.integers(0, 2, len(ids)).astype(np.uint8)  # a prompt's 0, a reply's 1
        marks[ids == 0] = 2  # END: where an example ends
        marks[ends[::3]] = 0  # a template's own end-of-text, inside a conversation
        marks.tofile(tmp_path / "train.mask.bin")
        meta.update(masks=True, format_version=2)
    ids.tofile(tmp_path / "train.bin")
    T = 32
    split = Split(str(tmp_path), "train", meta, T, seed=1, examples=False, vocab_size=50)
    x, y, doc = (t.numpy() for t in split.whole(range((len(ids) - 1) // T - 1), 0, doc_mask=True))
    for b, start in enumerate(range(0, len(x) * T, T)):
        tokens, kept = ids[start:start + T + 1].astype(np.int64), marks[start:start + T + 1]
        assert (x[b] == tokens[:-1]).all() and (y[b] == np.where(kept[1:] == 1, tokens[1:], -1)).all()
        assert (doc[b] == np.cumsum((tokens[:-1] == 0) & ((kept[:-1] == 2) if masked else True))).all()
    examples = Split(str(tmp_path), "train", meta, T, seed=1, examples=True, vocab_size=50)
    x, y, doc = (t.numpy() for t in examples.packed(range(examples.sequences_in(1))))
    real, first = doc[:, 1:] <= T, doc[:, 1:] != doc[:, :-1]  # (padding: document T + 1)
    assert first[real].sum() > 50 and (y[:, :-1][first] == -1).all()  # every example's first token: none
    within = y[:, :-1][real & ~first]
    assert ((within == x[:, 1:][real & ~first]) | masked & (within == -1)).all()
    assert (within == -1).any() == masked and (within != -1).any()
