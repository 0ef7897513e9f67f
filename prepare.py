"""
Prepare a text corpus for training: files and folders in (read by sources.py, encoded by tokenizer.py),
DIR/train.bin, DIR/val.bin and DIR/meta.json out. What they hold, what is read, held or skipped: docs/data.md.

    python prepare.py --tokenizer=bpe:4096          # default corpus: this Python's stdlib -> data/stdlib
    python prepare.py input.txt --tokenizer=char --out_dir=data/shakespeare_char
    python prepare.py notes/ docs.jsonl.gz --out_dir=data/mine      # GPT-2 tokens, 10% of documents to val
    python prepare.py train.parquet --val_input=val.parquet --tokenizer=hf/tokenizer.json --out_dir=data/ft
    python prepare.py notes/ --analyze              # what would be read, skipped, and how long documents are
"""

import argparse
import atexit
import errno
import json
import os
import signal
import sysconfig
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext, suppress
from functools import cache
from hashlib import blake2b
from itertools import chain, islice
from pathlib import Path

import numpy as np
from tqdm import tqdm

from lib.chat import TRAIN_ON, Chat, ChatFormat
from lib.files import (DATA_FORMAT, END, MARKER, OUTPUTS, UserError, check_replace, durable_replace, lock_folder,
                      one_line_errors, open_own, unlock_folder)
from lib.sources import (HARD_CUT, BigText, HubSplit, check_hub_folders, corpus, ext_stats, hub_split, hub_splits,
                         new_stats, pieces, shown, val_files)
from lib.tokenizer import make_tokenizer

BATCH_CHARS = 1 << 16  # documents are grouped into ~64 KB batches for the encoder threads
SAFE_ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base")  # and bpe:N


# -----------------------------------------------------------------------------
# encoding: ~64 KB batches of documents and pieces, encoded by a pool of threads, results in order

def encode_batch(tokenizer, texts, ends, is_val, dtype, wholes, min_length, starts):
    """-> ((train ids, val ids), (train masks, val masks) or None, tokens and bytes per text, dropped per text). BOS
    (if any) before a document's first piece (starts), end-of-text after its last; a whole document (wholes) under
    min_length tokens of text is dropped. A Chat's mask: 1 per trained token, END at its end-of-text (train.py cuts)."""
    masks = None
    if texts and isinstance(texts[0], Chat):
        pairs = [tokenizer.encode_chat(chat.text, chat.spans) for chat in texts]
        ids = [np.append(a, np.uint32(tokenizer.eot_id)) for a, _ in pairs]
        masks = [np.append(m, np.uint8(END)) for _, m in pairs]
        texts = [chat.text for chat in texts]
    else:  # a conversation's BOS is in its text: the template's, or the tokenizer's before plain prompt strings
        ids = tokenizer.encode_docs(texts, ends, starts)
    bos = int(masks is None and tokenizer.bos_id is not None)  # the tokenizer's, before a whole document's text
    dropped = [bool(whole) and len(a) - end - bos < min_length for a, end, whole in zip(ids, ends, wholes)]

    def by_split(arrays, kind):
        parts = ([a for a, v, d in zip(arrays, is_val, dropped) if not v and not d],
                 [a for a, v, d in zip(arrays, is_val, dropped) if v and not d])
        return tuple(np.concatenate(p).astype(kind) if p else np.empty(0, kind) for p in parts)

    return (by_split(ids, dtype), masks and by_split(masks, np.uint8), [len(a) for a in ids],
            [len(t.encode("utf-8")) for t in texts], dropped)


def encoded(docs, tokenizer, dtype, num_workers, in_one_piece, min_length, stats):
    """docs: (is_val, ext, doc, start, stop) -> yields ([(is_val, is_last, ext)], encode_batch's result) per
    batch, one entry per piece. Batches don't depend on num_workers, so neither do the outputs."""
    # (text, is_last, is_val, ext, whole: the document's only piece, is_first) per piece
    items = ((text, end, is_val, ext, i == 0 and end, i == 0) for is_val, ext, doc, start, stop in docs
             for i, (text, end) in enumerate(pieces(doc, start, stop, in_one_piece, stats)))
    with ThreadPoolExecutor(num_workers) as pool:
        pending = deque()  # at most 2 batches per worker in flight, so that memory stays bounded
        batch, size = [], 0
        for item in chain(items, [None]):
            if item is not None:
                batch.append(item)
                size += len(item[0].text if isinstance(item[0], Chat) else item[0])
            if batch and (size >= BATCH_CHARS or item is None):
                texts, ends, flags, exts, wholes, starts = zip(*batch)
                job = pool.submit(encode_batch, tokenizer, texts, ends, flags, dtype, wholes, min_length, starts)
                pending.append((list(zip(flags, ends, exts)), job))
                batch, size = [], 0
            while pending and (len(pending) > 2 * num_workers or item is None):
                infos, job = pending.popleft()
                yield infos, job.result()  # a UserError in a thread (a character a vocabulary lacks) raised here

# -----------------------------------------------------------------------------
# the run: check arguments -> learn the vocabulary -> encode into .tmp files -> balance splits -> move into place

def prepare(args):
    """Run prepare.py with parsed args; returns meta.json's content (or the --analyze report)."""
    started = time.time()
    inputs, out, replacing = check_arguments(args)
    # an out_dir inside an input is not read; nor, as training data, are --val_input's files an input holds
    local = [*(args.val_input or []), *([out] if args.out_dir or not args.analyze else [])]  # (--analyze: no out)
    exclude = {Path(p).resolve() for p in local if isinstance(p, (str, Path))}
    threads = max(1, args.num_workers or cpu_count())

    learning = time.time()  # char, bpe:N and wordpiece:N learn their vocabulary in a first pass over the corpus
    texts = lambda: (getattr(text, "text", text) for _, _, doc, _, _ in  # a pass with stats of its own
                     labelled_documents(args, inputs, exclude, new_stats()) for text, _ in pieces(doc))
    args.chat = chat_maker(args, None)
    tokenizer = make_tokenizer(args.tokenizer, texts)
    args.chat = chat_maker(args, tokenizer)
    learned = args.tokenizer == "char" or args.tokenizer.startswith(("bpe:", "wordpiece:"))
    seconds = {"learn": time.time() - learning if learned else 0.0}  # one loaded, not learned: no time to report
    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32

    stats = new_stats()
    docs = labelled_documents(args, inputs, exclude, stats)
    docs, split_method, single_ext = plan_split(args, inputs, docs, stats)
    writing = nullcontext({}) if args.analyze else temporary_outputs(out, args.overwrite)  # --analyze writes nothing
    with writing as files:
        encoding = time.time()
        min_length = 0 if single_ext is not None else args.min_length  # a single document's is its whole's
        splits, last, histogram = encode_and_write(docs, tokenizer, dtype, files, stats, threads, min_length)
        seconds["encode"] = max(time.time() - encoding, 1e-6)
        if single_ext is not None:  # the head and tail of one document were counted as two
            ext_stats(stats, single_ext)["documents"] -= 1
            check_whole_length(splits, tokenizer, args.min_length)
        elif files and args.val_input is None and args.val_fraction > 0:
            balance_splits(splits, last, files, np.dtype(dtype).itemsize, stats["conversations"])
        conversations = stats.pop("conversations")
        check_splits(args, inputs, splits, conversations, stats)
        meta = {
            "format_version": DATA_FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size,
            "eot_id": tokenizer.eot_id, "tokenizer": {"kind": tokenizer.kind, "name": tokenizer.name}, **splits,
            "split": {"method": split_method, "val_fraction": None if args.val_input else args.val_fraction},
            "masks": bool(conversations),  # and the template, where a record was written with it (sample.py --chat)
            **({"chat": args.chat().meta(tokenizer)} if conversations and args.chat().templated else {}),
            "inputs": [shown(p) for p in inputs], "val_inputs": [shown(p) for p in args.val_input or []],
            **stats,  # files_read ... duplicates_dropped: what was read and skipped
            "document_tokens_histogram": {f"{2**k}-{2**(k+1)-1}": histogram[k] for k in sorted(histogram)}}
        if args.analyze:
            report_analyze(meta)
            return meta
        move_into_place(out, files, tokenizer, meta)

    report_run(meta, out, replacing, seconds, started, threads)
    if meta["masks"]:
        report_example(out, tokenizer, meta)
    if meta.get("chat", {}).get("template_from") == "built-in" and os.path.exists(args.tokenizer):
        print(f"warning: {args.tokenizer} has no chat template (chat_template.jinja, or chat_template in "
              f"tokenizer_config.json): the built-in one was used, which that model never saw; give it its own "
              f"with --chat_template=FILE")
    return meta


def check_splits(args, inputs, splits, conversations, stats):
    # a dataset that would train on nothing, or that train.py would refuse (an empty val.bin), is refused unwritten
    dropped = f"{stats['duplicates_dropped']} duplicates (--dedup) and {stats['short_dropped']} documents under " \
              f"--min_length were dropped in all; " if stats["duplicates_dropped"] + stats["short_dropped"] else ""
    if not args.analyze and (splits["val"]["documents"] == 0 < args.val_fraction or not splits["train"]["documents"]):
        report_skips(stats)  # what was left out, and why
    if args.val_input and splits["val"]["documents"] == 0:
        raise UserError(f"no documents left in --val_input {', '.join(map(str, args.val_input))} ({dropped}check it)")
    if not args.val_input and args.val_fraction > 0 and splits["val"]["documents"] == 0 and not args.analyze:
        raise UserError(f"no document left for validation: {', '.join(map(str, inputs))} gave "
                        f"{splits['train']['documents']}, too few to split ({dropped}add documents, or give "
                        f"--val_input)")
    if splits["train"]["documents"] == 0 and not args.analyze:
        raise UserError(f"no training documents in {', '.join(map(str, inputs))} (check it)")
    if conversations and splits["train"].get("targets", 0) == 0:
        raise UserError(f"the masks of {', '.join(map(str, inputs))} select no token to train on (check "
                        f"--train_on and the template)")


def chat_maker(args, tokenizer):
    """-> chat(): the ChatFormat, made at the first conversation (texts need none), of --chat_template or the
    tokenizer folder's template, with its special tokens (before bpe:N is learned, the end-of-text to come)."""
    @cache
    def chat():
        specials = tokenizer.special_tokens() if tokenizer else {"<|endoftext|>": None}
        if not specials:
            raise UserError(f"conversations need a tokenizer with special tokens to mark turns, and "
                            f"{tokenizer.name} has none: use bpe:N, a tiktoken encoding or the model's "
                            f"tokenizer.json")
        eot = tokenizer.decode([tokenizer.eot_id]) if tokenizer else "<|endoftext|>"
        folder = args.tokenizer if os.path.exists(args.tokenizer) else None
        try:
            bos = tokenizer.decode([tokenizer.bos_id]) if tokenizer and tokenizer.bos_id is not None else ""
            return ChatFormat.for_tokenizer(folder, specials, eot, args.train_on, args.chat_template, bos)
        except (ValueError, OSError) as e:
            raise UserError(str(e))
    return chat


def check_arguments(args):
    """-> (inputs, out_dir, whether it holds an incomplete dataset to replace); dies at a bad argument."""
    inputs = args.input or [sysconfig.get_paths()["stdlib"]]
    if args.val_input is None and len(inputs) == 1 and inputs[0].startswith("hf:") and ":" not in inputs[0][3:]:
        if "validation" in hub_splits(inputs[0][3:], args.hf_config):  # its validation split
            args.val_input = [inputs[0] + ":validation"]
    inputs, args.val_input = ([hub_split(i, args.hf_config) if i.startswith("hf:") else i for i in paths]
                              for paths in (inputs, args.val_input or []))
    args.val_input = args.val_input or None
    for path in inputs + (args.val_input or []):
        if not isinstance(path, HubSplit) and not os.path.exists(path):
            raise UserError(f"no such input: {path} (check the path)")
    for group in (inputs, args.val_input or []):  # each file read once: else in both splits, or twice in one
        files = [(p, Path(p).resolve()) for p in group if not isinstance(p, HubSplit)]
        for (path, real), (other, other_real) in [(a, b) for i, a in enumerate(files) for b in files[:i]]:
            if real.is_relative_to(other_real) or other_real.is_relative_to(real):
                raise UserError(f"the inputs {other} and {path} overlap (the same, or one inside the other): "
                                f"pass each file once")
    for path, val in [(p, v) for p in inputs for v in args.val_input or []]:  # trained on and validated on
        files = not isinstance(path, HubSplit) and not isinstance(val, HubSplit)
        if path == val or files and Path(path).resolve().is_relative_to(Path(val).resolve()):
            raise UserError(f"{path} is --val_input {val} or inside it: pass it as an input or as --val_input")
    for path in [p for p in inputs + (args.val_input or []) if isinstance(p, HubSplit)]:  # (the Hub is asked)
        if path.split not in (splits := hub_splits(path.name, path.config)):
            raise UserError(f"hf:{path.name} has no split {path.split!r}: it has {', '.join(map(repr, splits))}")
    if not 0 <= args.val_fraction < 1:
        raise UserError(f"--val_fraction must be in [0, 1), got {args.val_fraction}")
    if min(args.num_workers, args.min_length) < 0:  # (--num_workers=-1 ran one thread; 0 is every core's)
        raise UserError(f"--num_workers and --min_length are counts, at least 0: got {args.num_workers} and "
                        f"{args.min_length}")
    if args.chat_template and not os.path.isfile(args.chat_template):  # found out now, not at the first conversation
        raise UserError(f"no such --chat_template file: {args.chat_template} (give a Jinja template's file, e.g. a "
                        f"model folder's chat_template.jinja)")
    out = Path(args.out_dir or ("data/stdlib" if not args.input else ""))
    if args.analyze:
        return inputs, out, False
    if not args.out_dir and args.input:
        raise UserError("where should the dataset go? (pass --out_dir DIR)")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out_dir {out} is a file (pass a folder)")
    for path in [p for p in inputs + (args.val_input or []) if not isinstance(p, HubSplit)]:
        if Path(path).resolve() == out.resolve():  # (a folder inside an input is left out of it)
            raise UserError(f"--out_dir {out} is the input {path}: its dataset would be read as input the next time; "
                            f"give the dataset a folder of its own, e.g. --out_dir {out / 'tokens'}")
    check_hub_folders(inputs, args.val_input or [], out)
    return inputs, out, check_replace(out, args.overwrite)


def labelled_documents(args, inputs, exclude, stats):
    """Yield (is_val, ext, doc, start, stop: which characters of doc), --val_input's documents last. Without it, a hash
    of a document's name picks its split (the same every run and worker count); --dedup spans both splits."""
    seen = set(reserved := val_files(args.val_input or []))  # val's files: left out of training, however named
    for key, ext, doc in corpus(inputs, args, stats, only_py=not args.input, exclude=exclude, seen=seen):
        digest = blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
        is_val = args.val_input is None and int.from_bytes(digest, "little") < args.val_fraction * 2**64
        yield is_val, ext, doc, 0, None
    seen -= reserved  # (read as val now)
    for key, ext, doc in corpus(args.val_input or [], args, stats, exclude=exclude, seen=seen):
        yield True, ext, doc, 0, None


def plan_split(args, inputs, docs, stats):
    """Peek at the first two documents -> (docs, how they are split, the extension of the single document
    whose tail is val, or None). With no documents at all, stop before any folder is made."""
    first = list(islice(docs, 2))
    if not first:
        report_skips(stats)
        raise UserError(f"no documents found in {', '.join(map(str, inputs))} (every file was skipped or empty; "
                        f"see above)")
    if len(first) == 1 and not args.val_input and args.val_fraction > 0 and not args.analyze \
            and not isinstance(first[0][2], Chat):
        # One document (tinyshakespeare): its last val_fraction is val, as in nanoGPT, cut at a line start if it can be
        _, ext, doc, _, _ = first[0]
        nchars = doc.nchars if isinstance(doc, BigText) else len(doc)
        pos = int(nchars * (1 - args.val_fraction))
        for where, sep in (("a line start", "\n"), ("a word start", " "), ("a character", None)):
            cut = next_cut(doc, nchars, pos, sep)
            if cut is not None and abs(cut - pos) <= (nchars - pos) // 2:  # val within half its share of the asked
                break
        if 0 < cut < nchars:  # else no split: a part would be empty
            halves = [(False, ext, doc, 0, cut), (True, ext, doc, cut, None)]
            return chain(halves, docs), f"tail of the single document, cut at {where}", ext
    return chain(first, docs), "val_input" if args.val_input else "hash of document name", None


def next_cut(doc, nchars, pos, sep):
    # just after the first sep at or past character pos that leaves text after it, else after the last one before
    # it, reading doc as a stream; None where doc has no sep (sep None: pos itself)
    cut, at = (pos if sep is None else None), 0  # at: the characters read
    for text, _ in pieces(doc) if sep else ():
        found = text.find(sep, max(pos - at, 0))
        if found != -1 and at + found + 1 < nchars:
            return at + found + 1
        found = text.rfind(sep, 0, max(pos - at, 0))
        cut = at + found + 1 if found != -1 else cut
        at += len(text)
    return cut


@contextmanager
def temporary_outputs(out, overwrite):
    """The token and mask files under .tmp names, opened empty, in out locked for this run alone (files.py: a
    second prepare.py is refused). After it, finished or stopped (or at exit: a tokenizer past its deadline, which
    exits at once), no .tmp file stays, nor an empty folder it made."""
    created, held, files = not out.exists(), [lock_folder(out, "prepare.py")], {}

    def remove():
        for f in files.values():
            with suppress(OSError):  # a full disk fails the close's flush too: the .tmp files still go
                f.close()
        for name in OUTPUTS:
            (out / (name + ".tmp")).unlink(missing_ok=True)
        if held:
            unlock_folder(out, held.pop(), made=created)
    atexit.register(remove)
    try:
        check_replace(out, overwrite)  # a dataset another prepare.py finished since the start: --overwrite or none
        files.update({name.removesuffix(".bin"): open_own(out / f"{name}.tmp", "w+b") for name in OUTPUTS[:4]})
        yield files
    finally:
        atexit.unregister(remove)
        remove()


def encode_and_write(docs, tokenizer, dtype, files, stats, threads, min_length):
    """Encode docs into files (none for --analyze), counting documents, tokens and bytes per split and per
    extension -> (the splits' counts, each split's last (tokens, bytes), document length histogram)."""
    splits = {split: {"documents": 0, "tokens": 0, "bytes": 0} for split in ("train", "val")}
    last = {}  # split -> (tokens, bytes) of its last document, to move it if the other split is empty
    histogram = {}  # log2(document length in tokens) -> documents
    doc_tokens = doc_bytes = 0  # of the document so far: a big one comes in pieces
    bar = tqdm(unit="B", unit_scale=True, disable=None, desc="prepare")  # on stderr
    # sources.SAFE_CUT is checked for these pre-tokenizers only; any other tokenizer gets whole documents.
    in_one_piece = tokenizer.kind == "huggingface" or (tokenizer.kind == "tiktoken"
                                                       and tokenizer.name not in SAFE_ENCODINGS)
    doc = {"pieces": 0}  # the document under way, for drop_short_pieces
    framing = 1 + (tokenizer.bos_id is not None and not stats["conversations"])  # end-of-text, BOS: not its text
    for infos, (ids, masks, lens, sizes, dropped) in encoded(docs, tokenizer, dtype, threads, in_one_piece,
                                                             min_length, stats):
        ids, dropped = drop_short_pieces(infos, ids, lens, dropped, files, doc, min_length, framing)
        if tokenizer.unk_id not in (None, tokenizer.eot_id, tokenizer.bos_id):  # (text it cannot spell)
            stats["unknown_tokens"] += sum(int(np.count_nonzero(np.asarray(p) == tokenizer.unk_id)) for p in ids)
        for split, i in (("train", 0), ("val", 1)):
            if files:
                files[split].write(ids[i])
            if files and masks:
                files[f"{split}.mask"].write(masks[i])
            if masks:
                splits[split]["targets"] = splits[split].get("targets", 0) + int((masks[i] == 1).sum())
        for (is_val, is_last, ext), ntokens, nbytes, short in zip(infos, lens, sizes, dropped):
            if short:  # fewer tokens than --min_length: left out
                stats["short_dropped"] += 1
                doc_tokens = doc_bytes = 0
                continue
            doc_tokens += ntokens
            doc_bytes += nbytes
            if not is_last:
                continue
            split = "val" if is_val else "train"
            for counts in (splits[split], ext_stats(stats, ext)):
                counts["documents"] += 1
                counts["tokens"] += doc_tokens
                counts["bytes"] += doc_bytes
            last[split] = (doc_tokens, doc_bytes)
            bucket = (doc_tokens - framing).bit_length() - 1  # a power of two, of the text's length
            histogram[bucket] = histogram.get(bucket, 0) + 1
            doc_tokens = doc_bytes = 0
        bar.update(sum(sizes))
        ntokens_so_far = splits["train"]["tokens"] + splits["val"]["tokens"]
        bar.set_postfix(files=stats["files_read"], tokens=human(ntokens_so_far), refresh=False)
    bar.close()
    return splits, last, histogram


def drop_short_pieces(infos, ids, lens, dropped, files, doc, min_length, framing):
    """-> (ids, dropped) less each document of several pieces (one too long to encode at once; encode_batch drops
    one-piece ones) ending in this batch under min_length tokens of text (framing: its end-of-text and BOS, not
    counted): its last piece marked dropped, earlier batches' pieces cut off its file. doc: the one under way,
    {"pieces", "tokens", "begin" (here, or None), "file_start"}."""
    if not min_length:
        return ids, dropped
    keep, at, dropped = [np.ones(len(a), bool) for a in ids], [0, 0], list(dropped)
    for i, ((is_val, is_last, _), ntokens, short) in enumerate(zip(infos, lens, dropped)):
        if short:
            continue
        if doc["pieces"] == 0:
            doc.update(tokens=0, begin=at[is_val])
        doc["pieces"] += 1
        doc["tokens"] += ntokens
        at[is_val] += ntokens
        if is_last and doc["pieces"] > 1 and doc["tokens"] - framing < min_length:
            keep[is_val][doc["begin"] or 0:at[is_val]] = False
            if doc["begin"] is None and files:  # begun in an earlier batch: cut off what it wrote
                written = files["val" if is_val else "train"]
                written.truncate(doc["file_start"])
                written.seek(doc["file_start"])
            dropped[i] = True
        if is_last:
            doc["pieces"] = 0
    if doc["pieces"]:  # under way: where its pieces begin in its file once this batch is written
        is_val = infos[-1][0]
        if files and doc["begin"] is not None:
            kept_before = int(keep[is_val][:doc["begin"]].sum())
            doc["file_start"] = files["val" if is_val else "train"].tell() + kept_before * ids[is_val].itemsize
        doc["begin"] = None
    return [a[k] for a, k in zip(ids, keep)], dropped


def check_whole_length(splits, tokenizer, min_length):
    # --min_length for the single document whose head is train and tail val: the whole document's tokens
    framing = 1 + (tokenizer.bos_id is not None)  # each half's end-of-text, and BOS
    text_tokens = splits["train"]["tokens"] + splits["val"]["tokens"] - 2 * framing
    if text_tokens < min_length:
        raise UserError(f"the one document has {text_tokens:,} tokens, fewer than --min_length={min_length}: "
                        f"nothing is left to train on (lower --min_length)")


def balance_splits(splits, last, files, itemsize, masked):
    """Each split gets at least one document: an empty one takes the other's last, with its mask if any."""
    for empty, full in (("val", "train"), ("train", "val")):
        if splits[empty]["documents"] == 0 and splits[full]["documents"] >= 2:
            ntokens, nbytes = last[full]
            moved = {"documents": 1, "tokens": ntokens, "bytes": nbytes}
            for suffix, size in (("", itemsize), (".mask", 1)) if masked else (("", itemsize),):
                source = files[full + suffix]
                start = source.seek(-ntokens * size, os.SEEK_END)  # where the last document's ids begin
                while chunk := source.read(1 << 24):  # a document may be big
                    files[empty + suffix].write(chunk)
                    if suffix:
                        moved["targets"] = moved.get("targets", 0) + int((np.frombuffer(chunk, np.uint8) == 1).sum())
                source.truncate(start)
            splits[full] = {key: splits[full][key] - moved.get(key, 0) for key in splits[full]}
            splits[empty] = moved


def move_into_place(out, files, tokenizer, meta):
    """Rename the .tmp outputs into place, meta.json last. The old dataset stays whole until the marker is made;
    until it is removed, killed or not, the folder says it is incomplete (train.py refuses it, a rerun replaces it)."""
    meta["tokenizer"], tokenizer_file = tokenizer.save(out)
    with open_own(out / "meta.json.tmp", "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    for written in files.values():  # token files reach the disk before the marker (a full disk: the old one whole)
        written.flush()
        os.fsync(written.fileno())
        written.close()
    for name in filter(None, (tokenizer_file, "meta.json")):  # and so do the others: a rename may outlive a power cut
        with open(out / (name + ".tmp"), "rb") as f:  # that their bytes do not
            os.fsync(f.fileno())
    try:  # (a killed run's marker stays as it is: its dataset is not whole)
        if not (out / MARKER).exists():
            with open_own(out / MARKER, "w") as f:
                f.write("prepare.py stopped while writing this dataset: it is incomplete; run prepare.py again\n")
                f.flush()
                os.fsync(f.fileno())  # the marker reaches the disk before any rename
    except BaseException:  # no rename yet: the dataset there before is whole, and no marker may say otherwise
        (out / MARKER).unlink(missing_ok=True)
        raise
    for signum in [s for s in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(s) is stopped]:
        signal.signal(signum, signal.SIG_IGN)  # from the first rename on it finishes: stopped's line would not be true
    (out / "meta.json").unlink(missing_ok=True)
    masks = ("train.mask.bin", "val.mask.bin") if meta.get("masks") else ()
    written = list(filter(None, ("train.bin", "val.bin", *masks, tokenizer_file, "meta.json")))  # tiktoken: no file
    for name in written:
        durable_replace(out / (name + ".tmp"), out / name)
    for name in set(OUTPUTS) - set(written):  # the dataset's it replaced (--overwrite): its masks, its tokenizer file
        with suppress(FileNotFoundError, IsADirectoryError):
            (out / name).unlink()
    (out / MARKER).unlink()


def cpu_count():
    """The cores this process may use; all of them where the OS can't say (macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def human(n, unit=""):
    """15300000 -> '15.3M'; with unit 'B': '15.3 MB'."""
    for suffix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or suffix == "T":
            return (f"{n:.0f}" if not suffix else f"{n:.1f}") + (" " if unit else "") + suffix + unit
        n /= 1000

# -----------------------------------------------------------------------------
# reports

def report_run(meta, out, replacing, seconds, started, threads):
    ndocs = sum(counts["documents"] for counts in meta["extensions"].values())  # a document cut in two is one
    nbytes, ntokens = (meta["train"][key] + meta["val"][key] for key in ("bytes", "tokens"))
    print(f"read {meta['files_read']} files, {ndocs} documents, {human(nbytes, 'B')} -> {out}/"
          + (" (replacing the incomplete dataset a killed run had left there)" if replacing else ""))
    print(f"tokenizer: {meta['tokenizer']['name']} (vocab {meta['vocab_size']}, end-of-text {meta['eot_id']}, "
          f"{meta['dtype']})" + (f", learned in {seconds['learn']:.1f} s" if seconds["learn"] > 0.5 else ""))
    kind, _, asked = meta["tokenizer"]["name"].partition(":")
    made = meta["vocab_size"] - (kind == "bpe")  # bpe:N's N tokens, then end-of-text; wordpiece:N's N count its own
    if kind in ("bpe", "wordpiece") and made < int(asked) and seconds["learn"]:  # (learned here, not reused)
        print(f"note: the corpus held too little text to learn {asked} tokens: it has {made}"
              f"{' and end-of-text' if kind == 'bpe' else ''} (more text gives more)")
    if kind == "wordpiece" and made > int(asked) and seconds["learn"]:  # a character: a token alone, and as a 2nd
        print(f"note: the corpus's characters alone make {made} WordPiece tokens, more than the {asked} asked for")
    for split in ("train", "val"):
        print(f"{split:>5}: {meta[split]['documents']:>9,} documents {meta[split]['tokens']:>13,} tokens")
    print(f"split: {meta['split']['method']}")
    val, train = meta["val"]["tokens"], meta["train"]["tokens"]
    if meta["split"]["method"] == "hash of document name" and val > train:  # few documents, a big one in val
        print(f"warning: val holds {val:,} of the {val + train:,} tokens, train the rest: too few documents to split "
              f"by name; pass --val_input FILES, or the corpus as one file, whose tail becomes val")
    report_skips(meta)
    print(f"tokenized {human(nbytes, 'B')} in {seconds['encode']:.2f} s with {threads} threads: "
          f"{nbytes / 1e6 / seconds['encode']:.1f} MB/s, {human(ntokens / seconds['encode'])} tokens/s; "
          f"{time.time() - started:.1f} s in all")


def report_example(out, tokenizer, meta):
    """The first training conversation as the model reads it, what it learns to write between [[ and ]]."""
    ids = np.fromfile(out / "train.bin", dtype=meta["dtype"], count=4096)
    mask = np.fromfile(out / "train.mask.bin", dtype=np.uint8, count=4096)
    end = next((i for i in np.flatnonzero(mask == END)), len(ids))
    runs = np.split(np.arange(end), np.flatnonzero(np.diff(mask[:end])) + 1)  # stretches of equal mask
    text = "".join(("[[{}]]" if mask[r[0]] == 1 else "{}").format(tokenizer.decode(ids[r].tolist()))
                   for r in runs if len(r))
    how = f"{meta['chat']['train_on']}, template: {meta['chat']['template_from']}" if "chat" in meta else \
        "prompt and completion as plain text, no template"
    print(f"{meta['train']['targets']:,} of {meta['train']['tokens']:,} training tokens are trained on ({how}); the "
          f"first example, its trained part in [[ ]]:\n{text}")


def report_skips(report):
    """What was left out, from meta.json's content or from the stats that go into it."""
    if report["skipped_files"]:
        print(f"skipped {report['files_skipped']} files" + (", the first:" if report["files_skipped"] > 20 else ":"))
        for skipped in report["skipped_files"][:20]:
            print(f"  {skipped['path']}: {skipped['reason']}")
    bad = report["bad_records"]
    if bad["count"]:
        print(f"skipped {bad['count']} bad records" + (", the first:" if bad["count"] > 20 else ":"))
        for example in bad["examples"][:20]:
            print(f"  {example}")
    short = f", {report['short_dropped']} shorter than --min_length" if report.get("short_dropped") else ""
    print(f"dropped {report['empty_documents']} empty documents, {report['duplicates_dropped']} duplicates{short}; "
          f"left out {report['hidden_skipped']} hidden files and folders")
    if report.get("unknown_tokens"):
        print(f"{report['unknown_tokens']:,} tokens are the tokenizer's unknown token: text it cannot spell")
    if report.get("hard_cuts"):
        print(f"cut text {report['hard_cuts']} times where {human(HARD_CUT)} characters held no safe place to cut "
              f"(its tokens there may differ from those of the text whole)")


def report_analyze(meta):
    ndocs, nbytes, ntokens = (meta["train"][key] + meta["val"][key] for key in ("documents", "bytes", "tokens"))
    print(f"analyze (nothing written): {meta['files_read']} files, {ndocs:,} documents, {human(nbytes, 'B')}, "
          f"{ntokens:,} tokens with {meta['tokenizer']['name']} (counting one end-of-text per document)")
    print(f"{'extension':>12} {'files':>8} {'documents':>10} {'bytes':>9} {'tokens':>12}")
    for ext, counts in sorted(meta["extensions"].items()):
        print(f"{ext:>12} {counts['files']:>8,} {counts['documents']:>10,} {human(counts['bytes'], 'B'):>9} "
              f"{counts['tokens']:>12,}")
    print("document length in tokens (without end-of-text):")
    top = max(meta["document_tokens_histogram"].values())
    for bucket, n in meta["document_tokens_histogram"].items():
        print(f"{bucket:>15} {n:>9,} {'#' * max(1, round(40 * n / top))}")
    report_skips(meta)

# -----------------------------------------------------------------------------

def main(argv=None):
    one_line_errors("prepare.py")
    p = argparse.ArgumentParser(description="Files and folders -> train.bin, val.bin, meta.json. "
                                            "Examples: see the top of prepare.py.")
    arg = p.add_argument
    arg("input", nargs="*", help="files or folders (default: this Python's standard library, .py files), or "
        "hf:NAME[:SPLIT] for a Hugging Face dataset (on the Hub, or a local folder laid out as one), streamed")
    arg("--out_dir", help="where the dataset goes (default for the stdlib corpus: data/stdlib)")
    arg("--tokenizer", default="gpt2", help="gpt2 | cl100k_base | o200k_base | ... | char | bpe:N | wordpiece:N "
                                            "| path to tokenizer.json | a prepared dataset folder")
    arg("--val_fraction", type=float, default=0.1, help="share of documents for validation (one document: its tail)")
    arg("--val_input", nargs="+", help="take validation documents from these files or folders instead")
    arg("--hf_config", help="hf:NAME: the dataset's configuration (e.g. wikitext-103-raw-v1)")
    arg("--field", help="the JSON field or parquet column holding the text (default: text, content or body)")
    arg("--train_on", default="assistant", choices=TRAIN_ON, help="conversations: what the model learns to "
        "write: each assistant turn (and the token closing it), the completion after the prompt, or all of it")
    arg("--chat_template", help="a Jinja chat template file for conversations (default: the tokenizer folder's, "
        "else a plain built-in one)")
    arg("--num_workers", type=int, default=0, help="encoder threads (default: all cores)")
    arg("--dedup", action="store_true", help="drop exact duplicate documents")
    arg("--min_length", type=int, default=0, help="drop documents of fewer tokens than this (end-of-text not "
        "counted)")
    arg("--strict", action="store_true", help="stop at the first bad file or record instead of skipping it")
    arg("--overwrite", action="store_true", help="replace a dataset already in --out_dir")
    arg("--analyze", action="store_true", help="report files, documents, tokens and lengths; write nothing")
    args = p.parse_args(argv)  # (a mistake in them: one line, files.one_line_errors)
    try:
        return prepare(args)
    except OSError as e:  # its .tmp files are gone by now, and the dataset there before is whole
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise UserError(f"the disk of {args.out_dir or 'data/stdlib'} is full ({e.strerror}); no dataset was written: "
            f"make room, or choose another --out_dir")


def stopped(signum, frame):
    # SIGTERM or SIGINT (Ctrl-C) as an exception, so that temporary_outputs removes its .tmp files and the lock
    raise SystemExit(f"prepare.py: stopped by {signal.Signals(signum).name}; no dataset was written, and its "
                     f"temporary files are removed")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    main()
