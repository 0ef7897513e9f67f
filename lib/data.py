"""
What train.py trains and evaluates on, read from prepare.py's token files (and masks, for conversations): windows
of the token stream (pretraining), each token once an epoch or at random places with replacement (as nanoGPT); or
whole examples packed best-fit into sequences (fine-tuning), each once an epoch. A batch is a pure function of the
seed and its number, so a resumed run sees the same batches. A target is -1 where nothing is learned: a masked-out
token (a user's turn), padding, or (examples) an example's first token, which nothing before it predicts (windows
under --train_on=all train it, from the example before).
"""

import bisect
import math
import os
import weakref
from typing import NamedTuple

import numpy as np
import torch

from lib.files import END, UserError, end_mark

CHUNK = 1 << 26  # tokens scanned at a time for the examples' ends


class Mode(NamedTuple):
    examples: bool  # a sequence is whole examples packed best-fit (they end at meta.json's eot_id), not a window
    epochs: bool  # an epoch draws every sequence once, in an order drawn from the seed (False: with replacement)


# the ways to draw a run's training sequences (sequences=NAME), read by the checks, the batches and the epochs
SEQUENCES = {
    "windows": Mode(examples=False, epochs=True),  # every token once an epoch, in windows, shuffled (pretraining)
    "random": Mode(examples=False, epochs=False),  # windows at random places, with replacement (nanoGPT's)
    "examples": Mode(examples=True, epochs=True),  # whole examples packed, each attending within itself (fine-tuning)
}


def check_sequences(sequences):
    """UserError, in one line with the fix, for a sequences setting no run knows (what the data can give:
    files.check_data_for_run)."""
    if sequences not in SEQUENCES:
        raise UserError(f"sequences={sequences!r} is not one of {', '.join(map(repr, SEQUENCES))}")


class Split:
    """One split (train or val): its tokens memory-mapped (mapped again for each batch: np.memmap leaks otherwise),
    its mask where it has one, and with examples=True where each example ends and how they pack. Its files are
    opened once: a dataset prepared again into data_dir (renamed into place) leaves this run reading its own."""

    def __init__(self, data_dir, split, meta, block_size, seed, examples, vocab_size):
        self.file = open(os.path.join(data_dir, f"{split}.bin"), "rb")
        self.mask_file = open(os.path.join(data_dir, f"{split}.mask.bin"), "rb") if meta.get("masks") else None
        for f in filter(None, (self.file, self.mask_file)):  # closed with the split
            weakref.finalize(self, f.close)
        self.dtype, self.eot_id, self.examples = np.dtype(meta["dtype"]), meta.get("eot_id"), examples
        self.end = end_mark(meta)  # the mask's value where an example ends
        self.block_size, self.seed, self.is_val = block_size, seed, split == "val"
        self.vocab_size = min(vocab_size, meta["vocab_size"])  # the model's, and the data's own (files.check_token_ids)
        self.epochs = {}  # epoch -> its sequences' order (epoch()), the last two met (examples: and the first)
        self.firsts = [0]  # the number of each epoch's first sequence, as far as epochs have been counted
        if examples:
            self.starts, self.lengths = example_bounds(self.tokens(), self.mask(), self.eot_id, self.end)
            self.cut = int((self.lengths > block_size + 1).sum())  # longer than a sequence: cut to fit
            self.targets = kept_targets(self.starts, self.lengths, self.mask(), block_size)

    def tokens(self):
        return np.memmap(self.file, dtype=self.dtype, mode="r")

    def mask(self):
        return np.memmap(self.mask_file, dtype=np.uint8, mode="r") if self.mask_file else None

    def windows(self, step, first, count, doc_mask):
        """Windows first to first + count - 1 of a step (evaluation uses step -1), each block_size + 1 tokens at a
        random place, drawn with replacement (sequences='random') -> (x, y, doc_ids or None)."""
        draws = np.random.PCG64([self.seed, self.is_val, step + 1]).random_raw(first + count)
        starts = draws[first:] % np.uint64(len(self.tokens()) - self.block_size)  # these windows'
        return self.rows(starts.astype(np.int64), np.zeros(count, dtype=np.int64), doc_mask)

    def shuffled(self, numbers, doc_mask, limit=None):
        """Windows numbers of the run, every token once an epoch (sequences='windows') -> (x, y, doc_ids or None);
        numbers from limit on are padding, as are the tokens a window reaches outside the split."""
        end = len(self.tokens())
        starts = np.array([self.sequence(n) if limit is None or n < limit else end for n in numbers], dtype=np.int64)
        return self.rows(starts, np.zeros(len(numbers), dtype=np.int64), doc_mask)

    def whole(self, numbers, overlap, doc_mask):
        """Windows numbers of the split, each block_size - overlap tokens after the one before and its first overlap
        tokens context only, so every token is a target once -> (x, y, doc_ids or None); past the end: padding."""
        starts = np.array(numbers, dtype=np.int64) * (self.block_size - overlap)
        return self.rows(starts, np.where(starts > 0, overlap, 0), doc_mask)

    def scored(self, numbers, overlap, doc_mask):
        """Sequences numbers of the split scored whole, every target once (train.py's evaluation, eval.py): its
        examples in the file's order, as packed() trains them, or whole()'s windows overlapping by overlap."""
        return self.packed(numbers) if self.examples else self.whole(numbers, overlap, doc_mask)

    def scored_count(self, overlap):
        """How many sequences scored() takes to score the whole split (whole examples, or windows)."""
        if self.examples:
            return self.sequences_in(1)
        return 1 + -(-max(0, len(self.tokens()) - 1 - self.block_size) // (self.block_size - overlap))

    def rows(self, starts, context, doc_mask):
        # block_size + 1 tokens from each start (end-of-text outside the split) -> x, y: -1 for the first context[b]
        # targets, past the end and where masked; a document begins after each end-of-text (one the mask marks END)
        T, data, mask = self.block_size, self.tokens(), self.mask()
        tokens = np.full((len(starts), T + 1), self.eot_id or 0, dtype=np.int64)
        marks = np.full((len(starts), T + 1), self.end, dtype=np.uint8)  # the mask's (1: trained; 1 without one)
        for row, start in enumerate(starts):
            at = max(0, -start)  # a shuffled window may begin before the split: padding up to its first token
            window = data[start + at:start + T + 1]
            tokens[row, at:at + len(window)] = window
            marks[row, at:at + len(window)] = mask[start + at:start + at + len(window)] if mask is not None else 1
        kept = marks == 1
        kept[np.arange(len(starts)), np.maximum(0, -starts)] &= starts >= 0  # the split's first token: no target
        self.check_ids(tokens, lambda b, t: int(starts[b]) + t)
        x = np.ascontiguousarray(tokens[:, :-1])  # a view would be pinned and copied to a GPU a row at a time
        y = np.where(kept[:, 1:] & (np.arange(T) >= context[:, None]), tokens[:, 1:], -1)
        doc_ids = None
        if doc_mask:
            ends = (x == self.eot_id) & (marks[:, :-1] == self.end if mask is not None else True)
            doc_ids = torch.from_numpy(ends.cumsum(axis=1))
        return torch.from_numpy(x), torch.from_numpy(y), doc_ids

    def packed(self, numbers, limit=None):
        """Sequences numbers of the run (epoch after epoch; none from limit on: all padding) -> (x, y, doc_ids),
        each (len(numbers), block_size). The validation split is one epoch in the file's order."""
        T, data, mask = self.block_size, self.tokens(), self.mask()
        tokens = np.full((len(numbers), T + 1), self.eot_id, dtype=np.int64)
        trained = np.zeros((len(numbers), T + 1), dtype=bool)
        doc_ids = np.full((len(numbers), T + 1), T + 1, dtype=np.int64)  # padding: a document of its own
        for row, n in enumerate(numbers):
            at = 0
            for doc, example in enumerate(self.sequence(n) if limit is None or n < limit else []):
                start, length = self.starts[example], min(self.lengths[example], T + 1)
                tokens[row, at:at + length] = data[start:start + length]
                trained[row, at:at + length] = mask[start:start + length] == 1 if mask is not None else True
                trained[row, at] = False  # an example's first token: nothing of it comes before to predict it
                doc_ids[row, at:at + length] = doc
                at += length
        self.check_ids(tokens, lambda b, t: None)
        y = np.where(trained[:, 1:], tokens[:, 1:], -1)
        x, doc_ids = np.ascontiguousarray(tokens[:, :-1]), np.ascontiguousarray(doc_ids[:, :-1])
        return torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(doc_ids)

    def packing(self):
        """How this split's examples pack into sequences, in one line for the log."""
        T, per_epoch = self.block_size, self.sequences_in(1)
        real = int(np.minimum(self.lengths, T + 1).sum())
        return (f"examples: {len(self.lengths):,} in training, packed into {per_epoch:,} sequences per epoch, "
                f"{real / (per_epoch * (T + 1)):.1%} of their tokens real; {self.cut_note()}")

    def cut_note(self):
        # what cutting the examples to a sequence costs, for the log (train's, and val's where any is cut)
        return (f"{self.cut} longer than block_size + 1 = {self.block_size + 1} tokens, cut to it, keeping "
                f"{self.targets[0] / max(self.targets[1], 1):.1%} of the trained tokens")

    def check_ids(self, tokens, position):
        # a bad id would index past the embedding: name it instead
        if tokens.max() >= self.vocab_size:
            b, t = np.argwhere(tokens >= self.vocab_size)[0]
            at = position(b, t)
            raise UserError(f"token id {tokens[b, t]}{'' if at is None else f' at position {at}'} of {self.file.name} "
                             f"is not below {self.vocab_size}, meta.json's vocab_size or the model's: the file does "
                             f"not match meta.json (re-run prepare.py)")

    def sequence(self, n):
        # sequence n of the run: the example numbers packed into it, or (windows) where its window starts
        if n >= self.counted_to(n):
            return []  # past the validation split's one epoch: padding
        epoch = bisect.bisect_right(self.firsts, n) - 1
        at = n - self.firsts[epoch]
        if self.examples:
            return self.epoch(epoch)[at]
        first, order = self.epoch(epoch)
        return first + self.block_size * int(order[at])

    def counted_to(self, n):
        # the epochs' first sequences (firsts) counted as far as sequence n's epoch (val: its one) -> the last's end
        while n >= self.firsts[-1] and not (self.is_val and len(self.firsts) > 1):
            self.firsts.append(self.firsts[-1] + self.epoch_size(len(self.firsts) - 1))
        return self.firsts[-1]

    def epoch_size(self, epoch):
        # the sequences an epoch holds; windows counted without drawing their order (a resume draws its epoch's alone)
        return len(self.epoch(epoch)) if self.examples else self.window_layout(epoch)[1]

    def window_layout(self, epoch):
        # (offset, count, rng) of a windows epoch: a window starts every block_size-th token from offset, drawn from
        # (seed, epoch) in [1, block_size], less block_size, so that every token after the first is a target once
        # (windows may reach past the split); rng then draws their order
        rng = np.random.default_rng([self.seed, epoch])
        offset = 1 + int(rng.integers(self.block_size))
        return offset, 1 + -(-(len(self.tokens()) - 1 - offset) // self.block_size), rng

    def epoch(self, epoch):
        # one epoch's sequences in order, drawn from (seed, epoch): the examples shuffled (val's in order), packed
        # best-fit; or (windows) where the first window starts, and the windows' numbers (window_layout) shuffled:
        # 4 bytes a window (10^11 tokens in windows of 256: 1.6 GB a process, two epochs held where a step straddles)
        if epoch not in self.epochs:
            # kept: the epoch before (a batch may straddle two) and, for examples, the first (evaluation reads
            # train's from it; it reads random windows, not these)
            self.epochs = {e: s for e, s in self.epochs.items() if e == epoch - 1 or e == 0 and self.examples}
            if self.examples:
                n = len(self.lengths)
                order = np.arange(n) if self.is_val else np.random.default_rng([self.seed, epoch]).permutation(n)
                sizes = np.minimum(self.lengths[order], self.block_size + 1)
                self.epochs[epoch] = [order[b].tolist() for b in best_fit(sizes.tolist(), self.block_size + 1)]
            else:
                offset, count, rng = self.window_layout(epoch)
                order = np.arange(count, dtype=np.int32 if count < 2**31 else np.int64)
                rng.shuffle(order)  # (rng.permutation(count)'s order, without its int64 arrays)
                self.epochs[epoch] = offset - self.block_size, order
        return self.epochs[epoch]

    def sequences_in(self, epochs):
        """How many sequences the first `epochs` epochs hold."""
        while len(self.firsts) <= epochs:
            self.firsts.append(self.firsts[-1] + self.epoch_size(len(self.firsts) - 1))
        return self.firsts[epochs]



def val_by_example(examples, eval_full, meta):
    # val as trained, each example on its own over its trained targets: with examples, or eval_full with masks
    return examples or bool(eval_full and meta.get("masks"))


def val_measure(config, meta):
    """What the val loss a run logs depends on beside the weights, as Batches measures it: whole examples (eval_stride
    and doc_mask play no part), every token in windows overlapping by eval_stride (eval_full), or random windows."""
    examples = SEQUENCES[config.get("sequences", "windows")].examples
    by_example = val_by_example(examples, config.get("eval_full"), meta)
    full = bool(config.get("eval_full")) or examples
    stride = config.get("eval_stride", -1) if full and not by_example else None
    return (config.get("block_size"), full, by_example, config["block_size"] // 2 if stride == -1 else stride,
            bool(config.get("doc_mask")) and not by_example)


class Batches:
    """What a run reads, on the device: the micro-batches of each step and evaluation, and the epochs a step has
    reached. Sequence n of the run is the same however processes and micro-steps share an update's sequences.

        batches = Batches("data/chat", meta, 1024, 1337, meta["vocab_size"], "examples", batch_size=8,
                          sequences_per_step=32, train_tokens=10**6, eval_sequences=400)
        x, y, doc_ids = batches.train(step=0, index=0)   # the first micro-batch of step 0
    """

    def __init__(self, data_dir, meta, block_size, seed, vocab_size, sequences, batch_size, sequences_per_step,
                 train_tokens, eval_sequences, doc_mask=False, eval_full=False, eval_stride=0, device="cpu"):
        self.mode, self.batch_size, self.sequences_per_step = SEQUENCES[sequences], batch_size, sequences_per_step
        self.eval_sequences = eval_sequences  # an evaluation's of a split, over all processes (but val scored whole)
        self.doc_mask, self.device = doc_mask, device
        self.eval_stride = block_size // 2 if eval_stride == -1 else eval_stride  # (settings.eval_stride's -1)
        self.pinned = device.startswith("cuda")  # batches copied from pinned memory while the GPU works on
        self.train_tokens, self.tokens_per_step = train_tokens, sequences_per_step * block_size
        self.val_by_example = val_by_example(self.mode.examples, eval_full, meta)
        self.splits = {"train": Split(data_dir, "train", meta, block_size, seed, self.mode.examples, vocab_size),
                       "val": Split(data_dir, "val", meta, block_size, seed, self.val_by_example, vocab_size)}
        # val scored whole, every target once: its examples, or strided windows
        self.scored_val = eval_full or self.mode.examples
        # micro-batches hold different numbers of targets (an epoch's part windows at the split's ends, a last step's
        # padding past max_epochs, masks, packed examples): the loop weighs each one's loss by its share
        self.weighted = self.mode.epochs or meta.get("masks", False)
        self.end_of_epochs = None  # sequences in max_epochs epochs (steps_for); past them, a step's are empty
        for name, split in self.splits.items():  # whole examples are cut to block_size: some may keep nothing to train
            if split.examples and split.targets[0] == 0:
                raise UserError(f"no {name} example keeps a trained token within its first block_size + 1 = "
                                f"{block_size + 1} tokens ({split.cut} of {len(split.lengths)} are longer): raise "
                                f"block_size")

    def steps_for(self, max_epochs):
        """The steps that make max_epochs epochs; from then on a step's sequences are empty."""
        if not self.mode.epochs:
            return math.ceil(max_epochs * self.train_tokens / self.tokens_per_step)
        self.end_of_epochs = self.splits["train"].sequences_in(max_epochs)
        return math.ceil(self.end_of_epochs / self.sequences_per_step)

    def padded_before(self, epochs_before, step):
        """The sequences of the epochs past epochs_before (a run's that ended there) that its steps to step took as
        padding, and a resume with more epochs never trains (its steps go on from step)."""
        if not (self.mode.epochs and epochs_before):  # (max_epochs 0 now: the steps go on by max_iters)
            return 0
        return max(0, min(step * self.sequences_per_step, self.end_of_epochs or math.inf)
                   - self.splits["train"].sequences_in(epochs_before))

    def train(self, step, index):
        """The index-th micro-batch of step (over every process: a process takes its own indices) -> x, y,
        doc_ids (None without doc_mask) on the device; y is -1 where nothing is learned."""
        split = self.splits["train"]
        if not self.mode.epochs:
            return self.to_device(split.windows(step, index * self.batch_size, self.batch_size, self.doc_mask))
        first = step * self.sequences_per_step + index * self.batch_size
        numbers = range(first, first + self.batch_size)
        if self.mode.examples:
            return self.to_device(split.packed(numbers, self.end_of_epochs))
        return self.to_device(split.shuffled(numbers, self.doc_mask, self.end_of_epochs))

    def evaluation(self, name, index):
        """The index-th micro-batch of split name's evaluation, the same every time -> x, y, doc_ids: of its first
        eval_sequences (the last micro-batch part full; None past them), or of val's every target once."""
        split, first = self.splits[name], index * self.batch_size
        whole = name == "val" and self.scored_val  # (evaluation_batches counts its batches; past the split: padding)
        count = self.batch_size if whole else min(self.batch_size, self.eval_sequences - first)
        if count <= 0:
            return None
        if whole or self.mode.examples:  # val's every target once, or the train split's examples packed
            return self.to_device(split.scored(range(first, first + count), self.eval_stride, self.doc_mask))
        return self.to_device(split.windows(-1, first, count, self.doc_mask))

    def evaluation_batches(self, replicas):
        """{split: micro-batches an evaluation of it reads in each process}: its eval_sequences shared out, or every
        val target once. Any micro-batch reads the same sequences (batch_size='auto' may choose another)."""
        val = self.splits["val"].scored_count(self.eval_stride) if self.scored_val else None
        share = math.ceil(self.eval_sequences / (self.batch_size * replicas))
        return {"train": share, "val": share if val is None else math.ceil(val / (self.batch_size * replicas))}

    def epoch(self, step):
        """Passes over the training split by the end of step: sequences over the split's, or tokens ('random')."""
        if self.mode.epochs:  # (a last step partly past max_epochs holds padding, not the next epoch)
            train, n = self.splits["train"], min(step * self.sequences_per_step, self.end_of_epochs or math.inf)
            train.counted_to(n)  # the epochs done, with the fraction of the current one
            epoch = bisect.bisect_right(train.firsts, n) - 1
            return epoch + (n - train.firsts[epoch]) / (train.firsts[epoch + 1] - train.firsts[epoch])
        return step * self.tokens_per_step / self.train_tokens

    def describe(self, eval_iters):
        """Which val loss the run logs, and (examples) how they pack."""
        val = ("each val example on its own, over its trained targets" if self.val_by_example else
               f"every token of val.bin once, in windows overlapping by {self.eval_stride}" if self.scored_val else
               f"{eval_iters} batches of random windows")
        val += f" ({self.splits['val'].cut_note()})" if self.val_by_example and self.splits["val"].cut else ""
        train = self.splits["train"]
        lost = self.mode.examples and train.targets[0] < train.targets[1] / 2  # (plain text: one example, the corpus)
        return f"val loss: {val}" + (f"\n{train.packing()}" if self.mode.examples else "") + (
            "\nwarning: cut to block_size, the examples lose most of their tokens: raise block_size (plain text: "
            "sequences='windows' trains on all of it)" if lost else "")

    def to_device(self, tensors):
        return [t if t is None else (t.pin_memory() if self.pinned else t).to(self.device, non_blocking=self.pinned)
                for t in tensors]


def example_bounds(data, mask, eot_id, end=END):
    """(starts, lengths) of the examples in a token file: each ends with its end-of-text, one the mask marks end
    where there is a mask (files.end_mark: a chat template may write end-of-text inside a conversation too)."""
    ends = []
    for at in range(0, len(data), CHUNK):
        found = np.flatnonzero(np.asarray(data[at:at + CHUNK]) == eot_id) + at
        ends.append(found[np.asarray(mask)[found] == end] if mask is not None else found)
    ends = np.unique(np.concatenate(ends + [np.array([len(data) - 1])]) + 1)  # one past each, and the file's end
    starts = np.concatenate([[0], ends[:-1]])
    return starts, ends - starts


def longest_example(data_dir, meta, split="val"):
    """The tokens of a split's longest example (a document, in a split without a mask), its end-of-text
    included; the whole split where there is no end-of-text."""
    data = np.memmap(os.path.join(data_dir, f"{split}.bin"), dtype=np.dtype(meta["dtype"]), mode="r")
    if meta.get("eot_id") is None or len(data) == 0:
        return len(data)
    mask = np.memmap(os.path.join(data_dir, f"{split}.mask.bin"), dtype=np.uint8, mode="r") if meta.get("masks") \
        else None
    return int(example_bounds(data, mask, meta["eot_id"], end_mark(meta))[1].max())


def kept_targets(starts, lengths, mask, block_size):
    """(targets left, targets) of examples cut to block_size + 1 tokens: an example's first token is no target,
    and with a mask only its trained tokens are."""
    if mask is None:
        return int((np.minimum(lengths, block_size + 1) - 1).sum()), int((lengths - 1).sum())
    kept = total = first = 0
    while first < len(starts):  # examples a CHUNK of tokens at a time, each chunk's running sum of the mask
        last = max(first + 1, int(np.searchsorted(starts, starts[first] + CHUNK, side="right")))
        low = starts[first]
        sums = np.concatenate([[0], np.cumsum(mask[low:starts[last - 1] + lengths[last - 1]] == 1, dtype=np.int64)])
        at, length = starts[first:last] - low, lengths[first:last]
        kept += int((sums[at + np.minimum(length, block_size + 1)] - sums[at + 1]).sum())
        total += int((sums[at + length] - sums[at + 1]).sum())
        first = last
    return kept, total


def best_fit(sizes, capacity):
    """Each size in turn into the open bin with the least room that still holds it (the latest of those), a new
    one when none does -> the bins, each a list of positions in sizes, in the order they were opened. Time
    linear in the sizes: bins are kept by their room, of which there are at most capacity kinds."""
    bins, by_room, rooms = [], {}, []  # by_room: room -> the bins with that room left; rooms: those rooms, sorted
    for i, size in enumerate(sizes):
        k = bisect.bisect_left(rooms, size)
        if k < len(rooms):
            room, b = rooms[k], by_room[rooms[k]].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room > size:
            if room - size not in by_room:
                bisect.insort(rooms, room - size)
            by_room.setdefault(room - size, []).append(b)
    return bins
