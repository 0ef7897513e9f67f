"""
The user's mistakes and the project's files, without torch (prepare.py reads this too).

One-line errors: library code raises UserError, one sentence naming the problem and the fix; once a script has
installed one_line_errors, an uncaught one prints as 'script.py: message' (exit status 1). Any other exception is a
bug and keeps its traceback.

Safe writes. One writer per folder: prepare.py and train.py (its master) hold fcntl.flock on FOLDER/.lock (naming
the writer), so a second run into it is refused at once; the OS drops the lock however the process ends. A finished
output takes its name with durable_replace once its bytes are on the disk (a crash leaves the old one or the new one,
whole), and nothing is written through a symbolic link the project did not make (open_own): a downloaded folder may
plant one where we write (out/metrics.jsonl -> ~/.bashrc).

A prepared dataset read back: meta.json (or nanoGPT's meta.pkl, read as plain values only, or nanoGPT's default:
GPT-2 tokens), whether prepare.py finished it, and its token files checked against it before training reads them.

    held = lock_folder("out", "train.py")        # UserError if another process writes out/ now
    meta = read_meta("data/stdlib")              # {"dtype": "uint16", "vocab_size": 4097, "eot_id": 4096, ...}
    ntokens = check_token_files("data/stdlib", meta, block_size=1024)
"""

import argparse
import atexit
import contextlib
import errno
import fcntl
import json
import math
import os
import sys
from hashlib import blake2b
from pathlib import Path

import numpy as np


class UserError(ValueError):
    """A mistake in what the user gave (a setting, a file, a folder); the message says what and how to fix it."""


def one_line_errors(script):
    """Print an uncaught UserError as one line labelled with the running script's name (train.py, ...), and nothing
    for output cut short by its reader (a BrokenPipeError). And a ~ that begins an argument's value (--out_dir=~/runs)
    is the home folder, as the shell makes it of --out_dir ~/runs but leaves it after an '=' (a folder named ~)."""
    for i, arg in enumerate(sys.argv[1:], 1):  # (not a prompt's: sample.py's --start and --system are text)
        key, eq, value = arg.partition("=")
        if key.startswith("--") and key not in ("--start", "--system", "--title") and value.split("/")[0] == "~":
            sys.argv[i] = key + eq + os.path.expanduser(value)
    default = sys.excepthook

    def parse_error(parser, message):  # argparse's, every script's: one line (and status 1), not its usage block
        raise UserError(f"{message} (see python {script} --help)")
    argparse.ArgumentParser.error = parse_error

    def hook(kind, error, traceback):
        if issubclass(kind, UserError):
            dist = sys.modules.get("torch.distributed")
            if not (dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                print(f"{script}: {error}", file=sys.stderr, flush=True)
            else:  # a process group in the interpreter's teardown, its peers gone, can abort the process after the
                # line (gloo's threads: "terminate called without an active exception", 1 run in 4 under torchrun even
                # once the group is ended): end it, do what atexit holds (the out_dir's lock), leave without teardown.
                # (The line as torch's hook around this one would print it on return, with the process's rank, in
                # one write: the other processes' lines go to the same pipe)
                os.write(sys.__stderr__.fileno(), f"[rank{dist.get_rank()}]: {script}: {error}\n".encode())
                dist.destroy_process_group()
                atexit._run_exitfuncs()
                sys.stdout.flush()
                os._exit(1)
        elif issubclass(kind, BrokenPipeError):  # the reader of its output is gone (sample.py | head): no more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (nor at exit, flushing what is left)
        else:
            default(kind, error, traceback)

    sys.excepthook = hook


# -----------------------------------------------------------------------------
# How our outputs reach the disk safely

LOCK_NAME = ".lock"


def lock_folder(folder, writer):
    """Lock folder (made if missing) for this process; returns what unlock_folder takes. UserError in one line,
    naming the process that holds it, when another process does."""
    path = os.path.join(folder, LOCK_NAME)
    while True:
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(link_refused(path)) from None
            raise UserError(unwritable(folder, e)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{folder} is being written by {holder}: wait for it to finish, or write into "
                             f"another folder") from None
        # the holder may have removed the file (unlock_folder) between our open and our lock: the lock is then on a
        # file no one else can see, and we try again with the new one
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{writer} (pid {os.getpid()})\n".encode(), 0)
    return fd


def link_refused(path):
    return f"{path} is a symbolic link, which this project never writes through: remove it, or choose another folder"


def open_own(path, mode="w", encoding=None):
    """open(path, mode) for a file this project writes, never following a link at path. 'w' modes (and 'w+b')
    replace whatever is there, a planted link included (the link goes, not the file it names), with a new file;
    'a' appends to a regular file and refuses a link in one line."""
    if not mode.startswith("a"):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    # appended to, or made anew (O_EXCL: a link planted again since the removal is refused, not followed)
    flags = os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if mode.startswith("a") else os.O_EXCL)
    try:
        fd = os.open(path, flags | (os.O_RDWR if "+" in mode else os.O_WRONLY), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(link_refused(path)) from None
        raise
    return os.fdopen(fd, mode, encoding=encoding)


@contextlib.contextmanager
def replaced_whole(path, mode="w", encoding=None):
    """open_own(path)'s file, written beside it and given path's name (durable_replace) only once whole and on the
    disk: a failure or a kill part way (a full disk) leaves whatever path held as it was. OSError: one line."""
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.tmp"  # its own, though two containers' pids may be equal
    try:
        with open_own(tmp, mode, encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        durable_replace(tmp, path)
    except OSError as e:
        kept = "; what was there is as it was" if os.path.lexists(path) else ""
        fix = "make room, or write elsewhere" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "write elsewhere"
        raise UserError(f"cannot write {path} ({e.strerror or e}){kept}: {fix}") from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def unwritable(out_dir, e):
    """The one line for an out_dir that could not be written at a run's start (e: the OSError): room to make, or
    another folder to choose."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"cannot write in out_dir={out_dir} ({e.strerror}): make room, and run it again (what it holds is as " \
            f"it was)"
    return f"cannot write in out_dir={out_dir} ({e.strerror}): choose a folder this user can write to, on a disk " \
        f"that is mounted"


def unlock_folder(folder, fd, made=False):
    # the lock file goes first, while still held, so that no one locks it after we let go of it; a folder the
    # locker made (made) goes too where nothing else was written in it
    with contextlib.suppress(OSError):  # the folder went with it, or went read-only (a stale lock stops no one)
        os.remove(os.path.join(folder, LOCK_NAME))
    os.close(fd)
    if made:
        with contextlib.suppress(OSError):  # not empty, or gone
            os.rmdir(folder)


def durable_replace(src, dst):
    """Rename src to dst (a file or a folder, replacing a file) and make the rename itself survive a power cut:
    the folder that holds the name is synced too."""
    os.replace(src, dst)
    try:
        folder = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    except OSError:  # a platform that cannot open folders (Windows): the rename is all there is
        return
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


# -----------------------------------------------------------------------------
# A prepared dataset read back

# A mask (train.mask.bin, a byte a token) says 1 where a token is trained, 0 where not, and END at the end-of-text
# prepare.py puts after each example: a template's own end-of-text inside a conversation (a turn's end) is no end
END = 2
DATA_FORMAT = 2  # meta.json's format_version as prepare.py writes it (2: the masks mark END); a newer one is refused


def end_mark(meta):
    """The mask's value at the end-of-text that ends an example: END, or 0 (every untrained one) in data prepared
    before format 2, which marked none."""
    return END if meta.get("format_version", 1) >= 2 else 0


MARKER = "prepare.incomplete"  # in a dataset's folder only while prepare.py renames its outputs into place
OUTPUTS = ("train.bin", "val.bin", "train.mask.bin", "val.mask.bin", "vocab.json", "tokenizer.json", "meta.json")
MAX_PICKLE = 1 << 26  # bytes of a meta.pkl read at most (nanoGPT's: under 1 KB for 65 characters)
MAX_VOCAB = 1 << 24  # 16.7M ids: released tokenizers have up to ~262K
MAX_JSON = 1 << 26  # bytes of a config.json, meta.json... read at most (parsed, ~9x that in memory); released: KBs


def check_replace(out, overwrite):
    """-> whether prepare.py's out (a Path) holds an incomplete dataset to replace; UserError where it holds outputs
    and not overwrite. Checked at the start, and again once out is locked: another prepare.py may have finished there
    meanwhile."""
    replacing = (out / MARKER).exists()  # a run killed while renaming left it: replace it
    held = [name for name in OUTPUTS if (out / name).exists()]  # a dataset's, or a model folder's tokenizer.json
    if held and not (overwrite or replacing):
        raise UserError(f"{out} already holds {', '.join(held)}, which prepare.py would replace (pass --overwrite "
                        f"to replace it, or another --out_dir)")
    return replacing


def refuse_unfinished(data_dir):
    if (Path(data_dir) / MARKER).exists():
        raise UserError(f"{data_dir} is a dataset prepare.py did not finish (re-run prepare.py)")


def read_meta(data_dir):
    """The folder's meta.json, with dtype as numpy's name and vocab_size an int (ours also hold eot_id, the tokenizer
    and counts); else, from nanoGPT's meta.pkl (characters), {dtype, vocab_size, eot_id: None, tokenizer}."""
    refuse_unfinished(data_dir)
    path = Path(data_dir) / "meta.json"
    if path.exists():
        check_json_size(path, "prepare the folder again with prepare.py")
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
            meta["dtype"] = np.dtype(meta["dtype"]).name
            vocab_size, eot_id = meta["vocab_size"], meta.get("eot_id")
            if meta["dtype"] not in ("uint16", "uint32"):  # uint8 over a uint16 file reads each id as two
                raise UserError(f"dtype {meta['dtype']} is not uint16 or uint32, what token files hold")
            if type(vocab_size) is not int or vocab_size < 1:
                raise UserError(f"vocab_size {vocab_size!r} is not a whole number above 0")
            if meta["dtype"] == "uint16" and vocab_size > 1 << 16:
                raise UserError(f"dtype uint16 cannot hold the ids of a vocab_size of {vocab_size}")
            if vocab_size > MAX_VOCAB:  # the model's embedding is sized from it before any token is read
                raise UserError(f"vocab_size {vocab_size:,} is past {MAX_VOCAB:,}, more than any tokenizer has "
                                f"(its embedding alone would not fit in memory): prepare the data again")
            if eot_id is not None and (type(eot_id) is not int or not 0 <= eot_id < vocab_size):
                raise UserError(f"eot_id {eot_id!r} is not a token id below vocab_size {vocab_size}")
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
            raise UserError(f"{path} is damaged ({why}); re-run prepare.py to write it again") from None
        if isinstance(meta.get("format_version"), int) and meta["format_version"] > DATA_FORMAT:
            raise UserError(f"{path} says format_version {meta['format_version']}: a newer prepare.py's, whose "
                            f"files this checkout would misread (it reads {DATA_FORMAT}); update it, or prepare the "
                            f"data here")
        return meta
    if (Path(data_dir) / "meta.pkl").exists():
        return {"dtype": "uint16", "vocab_size": len(nanogpt_chars(Path(data_dir) / "meta.pkl")), "eot_id": None,
                "tokenizer": {"kind": "nanogpt_char", "file": "meta.pkl"}}
    return {"dtype": "uint16", "vocab_size": 50257, "eot_id": 50256,
            "tokenizer": {"kind": "tiktoken", "name": "gpt2"}}


def check_meta_unchanged(data_dir, meta):
    """UserError where data_dir's meta.json no longer says meta (read_meta's): prepare.py --overwrite finished since,
    and the token files a script opened meanwhile may be the new dataset's, read as the old meta.json says."""
    if read_meta(data_dir) != meta:
        raise UserError(f"{data_dir} was prepared again while this run started (prepare.py --overwrite): its files may "
                        f"be the new dataset's read as the old one's; start the run again")


def tokenizer_fingerprint(data_dir, meta):
    """A digest of what decides which ids the folder's text became: meta's tokenizer entry, vocab_size, eot_id and
    the tokenizer's own file in the folder, if any. A checkpoint keeps its data's, so that whoever reads the run
    again refuses a folder prepared since with another tokenizer (even the same kind learned from other text)."""
    digest = blake2b(digest_size=8)
    spec = meta.get("tokenizer")
    digest.update(json.dumps([spec, meta["vocab_size"], meta.get("eot_id")], sort_keys=True).encode())
    name = spec.get("file") if isinstance(spec, dict) else None
    if isinstance(name, str) and name and name == os.path.basename(name):  # a file of the folder's own
        path = os.path.join(data_dir, name)
        check_regular(path, "prepare the data again (python prepare.py ...)")
        if os.path.isfile(path):
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def data_fingerprint(meta):
    """What a checkpoint keeps of its data beside its tokenizer's fingerprint: digests of the splits' sizes and of
    the chat template its conversations were made with (None without one), which preparing the folder again may
    change: a resume says so (resume.resume); sample.py and export.py refuse another template (trained.run_chat)."""
    chat = meta.get("chat") and {k: v for k, v in meta["chat"].items() if k not in ("template_from", "train_on")}
    splits = [meta.get(split, {}).get("tokens") for split in ("train", "val")]
    return {name: None if value is None else blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8)
            .hexdigest() for name, value in (("splits", splits), ("chat", chat))}


def read_plain_pickle(path):
    """The value pickled in path if it holds only dicts, lists, tuples, strings, numbers, booleans and None;
    else a UserError of one line. Nothing in the file is ever run."""
    import pickle  # (nanoGPT's meta.pkl only)

    def refused(what):
        return UserError(f"{path} holds objects other than plain values ({what}) and is not loaded; "
                          f"nanoGPT's meta.pkl holds only dicts, strings and integers")

    class PlainUnpickler(pickle.Unpickler):
        def find_class(self, module, name):  # a pickle runs code only by calling what it names: nothing is named
            raise refused(f"{module}.{name}")

    import io
    import pickletools
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PICKLE + 1)
        if len(data) > MAX_PICKLE:
            raise UserError(f"{path} is past {MAX_PICKLE >> 20} MB, which no nanoGPT meta.pkl is; not loaded")
        # its numbers are ids and sizes: whole and below 2**31, so that no two keys share a hash (ints' hashes are
        # not random: keys i * (2**61 - 1) all hash alike, and a dict of 150,000 of them takes minutes to build)
        big = next((arg for _, arg, _ in pickletools.genops(data) if type(arg) in (int, float) and
                    not (abs(arg) < 2**31 and arg == int(arg))), None)
        if big is not None:
            raise UserError(f"{path} holds the number {big!r}, not an id or a size (a whole number below 2**31); "
                            f"not loaded")
        value = PlainUnpickler(io.BytesIO(data)).load()
    except UserError:
        raise
    except Exception as e:  # a damaged pickle fails in many ways
        raise UserError(f"{path} is not a readable pickle ({type(e).__name__}: {e})") from None
    seen, todo = set(), [value]
    while todo:  # a loop, not recursion: the nesting may be deep, and a list may hold itself
        item = todo.pop()
        if type(item) not in (dict, list, tuple, str, int, float, bool, type(None)):
            raise refused(f"a {type(item).__name__}")
        if isinstance(item, (dict, list, tuple)) and id(item) not in seen:
            seen.add(id(item))
            todo.extend([*item.keys(), *item.values()] if isinstance(item, dict) else item)
    return value


def nanogpt_chars(path):
    """The characters of nanoGPT's meta.pkl, in id order: {'vocab_size': n, 'itos': {id: char},
    'stoi': {char: id}} for the ids 0..n-1, as its data/shakespeare_char/prepare.py writes it."""
    meta = read_plain_pickle(path)
    itos = meta.get("itos") if isinstance(meta, dict) else None
    chars = [itos.get(i) for i in range(len(itos))] if isinstance(itos, dict) else []
    characters = chars and all(isinstance(c, str) and len(c) == 1 for c in chars)
    stoi = {c: i for i, c in enumerate(chars)} if characters else None  # also what makes them distinct
    if not (characters and meta.get("stoi") == stoi and len(stoi) == meta.get("vocab_size") == len(chars)):
        raise UserError(f"{path} is not nanoGPT's meta.pkl of a character dataset (it needs vocab_size, "
                         f"and itos and stoi between the ids 0..vocab_size-1 and single characters)")
    return chars


def check_regular(path, fix):
    """UserError in one line where path is there but is not a regular file: a FIFO would hang its read, a device
    (/dev/zero) never end it."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise UserError(f"{path} is not a regular file (a FIFO, a device or a folder): {fix}")


def read_json(path, fix="replace it with the model's own file"):
    """A JSON file that holds an object (a model folder's config.json, tokenizer_config.json, an index...), read as
    data: UserError in one line, saying fix, for one that does not."""
    check_regular(path, fix)
    try:
        check_json_size(path, fix)
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror}): a Hugging Face model folder needs it") from None
    except (ValueError, RecursionError) as e:  # (nested past Python's stack: RecursionError)
        raise UserError(f"{path} is not valid JSON ({str(e)[:200]}): {fix}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object: {fix}")
    return data


def check_json_size(path, fix):
    # UserError in one line for a JSON file past MAX_JSON, before it is read
    if (size := os.path.getsize(path)) > MAX_JSON:
        raise UserError(f"{path} is {size / 2**20:,.0f} MB, past the {MAX_JSON >> 20} MB any such "
                        f"file needs: {fix}")


SCANNED = 1 << 30  # the ids a start checks at most (2 GB of uint16, ~2 s): a larger file's chunks spread over it


def check_token_ids(path, dtype, vocab_size, chunk=1 << 24):
    """UserError in one line unless every id of path, a non-empty token file of dtype (check_token_files checks it
    is one), is below vocab_size (meta.json's: an id past it but under the model's padded vocabulary would train a row
    no text has), read in memory-mapped chunks about as fast as the disk reads; of a file past SCANNED ids, every
    k-th chunk, SCANNED ids in all (a run's every batch is checked as it is read: data.Split.check_ids)."""
    ids = np.memmap(path, dtype=dtype, mode="r")
    for start in range(0, len(ids), chunk * -(-len(ids) // SCANNED)):
        piece = ids[start:start + chunk]
        if int(piece.max()) >= vocab_size:
            at = int(np.argmax(piece >= vocab_size))  # the first one, to name where the file goes wrong
            raise UserError(f"{path} holds token id {int(piece[at])} at position {start + at}, past meta.json's "
                             f"vocab_size {vocab_size}: it is not the data meta.json describes (prepare it again)")


def check_token_files(data_dir, meta, block_size, splits=("train", "val")):
    """The first split's length in tokens (train's, by default), once each split's file (train.bin and val.bin) holds
    whole tokens of meta's dtype, as many as it counted and more than block_size, a mask byte each where it says so,
    ids in its vocabulary; else UserError."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in splits:
        path = os.path.join(data_dir, f"{split}.bin")
        if not os.path.exists(path):
            raise UserError(f"no {path}: prepare the data first (python prepare.py --out_dir={data_dir} ..., or "
                            f"nanoGPT's data/NAME/prepare.py, whose folder train.py reads as it is)")
        check_regular(path, "prepare the data again (python prepare.py ...)")  # /dev/zero's size is 0
        size = os.path.getsize(path)
        if size == 0:
            raise UserError(f"{path} is empty: prepare the data with --val_fraction above 0 or --val_input")
        if size % itemsize:
            raise UserError(f"{path} has {size} bytes, not a whole number of {meta['dtype']} tokens: it is corrupt "
                             f"or meta.json's dtype is wrong (re-run prepare.py)")
        counted = meta[split].get("tokens") if isinstance(meta.get(split), dict) else None
        if isinstance(counted, int) and size // itemsize != counted:
            raise UserError(f"{path} holds {size // itemsize:,} {meta['dtype']} tokens where meta.json says "
                             f"{counted:,}: they are not from one prepare.py run (re-run prepare.py)")
        if size // itemsize <= block_size:
            raise UserError(f"{path} has {size // itemsize} tokens, too few for block_size={block_size} "
                             f"(lower block_size or prepare more data)")
        mask = os.path.join(data_dir, f"{split}.mask.bin")
        if meta.get("masks") and (not os.path.exists(mask) or os.path.getsize(mask) != size // itemsize):
            raise UserError(f"{mask} is missing or does not hold one byte per token of {path} (re-run prepare.py)")
    for split in splits:
        check_token_ids(os.path.join(data_dir, f"{split}.bin"), meta["dtype"], meta["vocab_size"])
    return os.path.getsize(os.path.join(data_dir, f"{splits[0]}.bin")) // itemsize


def check_data_for_run(data_dir, meta, vocab_size, doc_mask, sequences, block_size):
    """train.py's checks of its data -> (the model's vocab_size, 0 being the data's padded up to a multiple of 64;
    the training split's tokens). Windows need token files longer than block_size; whole examples, no minimum;
    documents (doc_mask) and whole examples, the end-of-text id."""
    from lib.data import SEQUENCES  # (here: prepare.py reads files.py, and needs no torch)
    if (doc_mask or SEQUENCES[sequences].examples) and meta.get("eot_id") is None:
        raise UserError(f"{'doc_mask=True' if doc_mask else f'sequences={sequences}'} needs the end-of-text id, and "
                        f"{os.path.join(data_dir, 'meta.json')} gives none (prepare the data with prepare.py, or set "
                        f"doc_mask=False and sequences='windows')")
    vocab_size = vocab_size or 64 * math.ceil(meta["vocab_size"] / 64)
    if meta["vocab_size"] > vocab_size:
        raise UserError(f"{os.path.join(data_dir, 'meta.json')} says the data has {meta['vocab_size']} token ids "
                        f"but the model's vocab_size is {vocab_size} (set vocab_size=0 to follow the data)")
    return vocab_size, check_token_files(data_dir, meta, 0 if SEQUENCES[sequences].examples else block_size)
