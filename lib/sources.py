"""
Reading a corpus (files, folders, JSON, CSV and parquet records, Hugging Face datasets) -> documents, each skip counted
and listed. Memory stays bounded: a big text file is checked whole, then given out in pieces cut at SAFE_CUT.

    from lib.sources import corpus, new_stats, pieces
    stats = new_stats()
    for key, ext, doc in corpus(["notes/"], args, stats):   # args: prepare.py's (field, dedup, strict, chat)
        text = "".join(piece for piece, _ in pieces(doc))
"""

import codecs
import contextlib
import csv
import dataclasses
import errno
import gzip
import json
import os
import re
import stat
import zlib
from collections import namedtuple
from functools import partial
from hashlib import blake2b
from pathlib import Path

from lib.chat import Chat, is_conversation
from lib.files import UserError

TEXT_FIELDS = ("text", "content", "body")
MAX_EXAMPLES = 100  # bad records listed in meta.json (all are counted)
PIECE = 1 << 16  # plain-text files are read, checked and encoded ~64 KB at a time
# Characters held with no SAFE_CUT (a 50 MB word) are cut here anyway, to bound memory; the report counts the cuts
HARD_CUT = 1 << 20
# A .jsonl line past this many bytes is skipped, never held (a CSV record: its file): json.loads takes ~20x its size
MAX_RECORD = 1 << 25
MAX_JSON = 1 << 28  # bytes of a .json, which is parsed whole (a .jsonl is read a record at a time)
# A .gz inflating past MAX_RATIO x the bytes read (after INFLATED_FREE) is refused: text packs 3-10x, a bomb ~1000x
MAX_RATIO = 100
INFLATED_FREE = 1 << 26
# What a file's first bytes say it was compressed with: only .gz is read (a gzip named otherwise is refused by name)
COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd",
              b"PK\x03\x04": "zip", b"7z\xbc\xaf\x27\x1c": "7z"}
BigText = namedtuple("BigText", "path nchars blank digest")  # a checked plain-text file too big to hold
# Where text can be cut so that its pieces, encoded apart, give the whole's tokens under the pre-tokenizers of GPT-2,
# cl100k, o200k and rustbpe (tests/test_prepare.py checks): before a space or newline between two letters or digits,
# or after a newline between a non-space and a letter or digit ("Z\n\n|X" or " \n|X" would change GPT-2's).
SAFE_CUT = re.compile(r"(?<=[^\W_])(?=[ \n][^\W_])|(?<=\S\n)(?=[^\W_])")
# The last SAFE_CUT in a text: the greedy .* backtracks from the end, so the first match is the last cut.
LAST_CUT = re.compile(r"(?s:.*)(?:" + SAFE_CUT.pattern + ")")


class SkipFile(Exception):
    """A file that cannot be read as documents; its message is the reason."""


class CheckedGzip(gzip.GzipFile):
    """A .gz read as GzipFile reads it, refused in one line (UserError) where it inflates past MAX_RATIO."""
    def read(self, size=-1):
        return self.checked(super().read(size))

    def readline(self, size=-1):
        return self.checked(super().readline(size))

    def checked(self, data):
        if self.tell() > max(INFLATED_FREE, MAX_RATIO * self.fileobj.tell()):  # text out, compressed bytes in
            raise UserError(f"{self.name} inflates to over {MAX_RATIO} times its size, as a compression bomb does: "
                            f"gunzip it and pass the text if it is meant, or leave it out")
        return data


def open_input(path):
    return CheckedGzip(path, "rb") if path.name.lower().endswith(".gz") else open(path, "rb")


class HubSplit(namedtuple("HubSplit", "name config split")):
    """A Hugging Face dataset's split (hf:NAME), read as a file of records is."""
    def __str__(self):
        return f"hf:{self.name}:{self.split}"


def check_hub_folders(inputs, val_inputs, out):
    """UserError where a local folder read as a Hub dataset (hf:DIR) overlaps a file input of the other split, or
    holds out (the dataset written): the datasets library reads every file in it, whatever we leave out (a file
    not named after a split is train's)."""
    def folder(split):
        return Path(split.name).resolve() if isinstance(split, HubSplit) and os.path.isdir(split.name) else None
    pairs = [(a, b) for a in inputs for b in val_inputs]
    for hub, other in pairs + [(b, a) for a, b in pairs]:
        if folder(hub) and not isinstance(other, HubSplit) and (Path(other).resolve().is_relative_to(folder(hub))
                                                                or folder(hub).is_relative_to(Path(other).resolve())):
            raise UserError(f"{other} and {hub} overlap, and the datasets library reads the folder whole: move "
                            f"{other} out of it, or pass the folder's files as plain inputs")
    for hub in [p for p in [*inputs, *val_inputs] if folder(p) and Path(out).resolve().is_relative_to(folder(p))]:
        raise UserError(f"--out_dir {out} is inside {hub}'s folder, which the datasets library reads whole: give "
                        f"the dataset a folder outside it")


def hub_split(spec, config):
    """'hf:NAME' or 'hf:NAME:SPLIT' (NAME: on the Hub, or a local folder laid out as a Hub dataset) -> HubSplit."""
    name, _, split = spec[3:].partition(":")
    return HubSplit(name, config, split or "train")


def hub_splits(name, config):
    try:
        import datasets
    except ImportError:
        raise UserError("hf:NAME reads Hugging Face datasets through the datasets library: pip install datasets") \
            from None
    try:
        return datasets.get_dataset_split_names(name, config)
    except Exception as e:  # not found, offline, a config needed: the library says which
        if config is None and "Config name is missing" in str(e):
            configs = ", ".join(datasets.get_dataset_config_names(name))
            raise UserError(f"the dataset hf:{name} has several configurations ({configs[:200]}): choose one with "
                            f"--hf_config=NAME") from None
        raise UserError(f"cannot read the dataset hf:{name} ({first_line(e)})") from None


def first_line(e):
    # an exception in one line: its type and its message's first line (pyarrow's and the datasets library's run on)
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:120]}"


def hub_rows(path, field=None):
    # a Hub split's records, streamed; a file of it the library cannot read (pyarrow's ArrowInvalid) stops it there
    import datasets
    try:
        if os.path.isfile(os.path.join(path.name, "state.json")):  # a folder Dataset.save_to_disk wrote
            split = datasets.load_from_disk(path.name).to_iterable_dataset()
        else:
            split = datasets.load_dataset(path.name, path.config, split=path.split, streaming=True)
        if split.features:  # media (an image's path, a URL) kept as stored, never opened: only text is read here
            split = split.cast(undecoded(split.features))
            if field and field not in split.features:  # said now, not at every row of the split
                raise SkipFile(f"no text column ({field}); it has {', '.join(split.features)[:80]}")
        rows = iter(split)
        while True:
            yield next(rows)
    except StopIteration:
        return
    except SkipFile:
        raise
    except Exception as e:  # whatever the library or pyarrow raise, named in one line
        raise SkipFile(f"unreadable ({first_line(e)})") from None


def undecoded(feature):
    # a dataset's features with every media kind (Image, Audio, Video, Pdf...) at decode=False, however deep
    if isinstance(feature, dict):
        return type(feature)({name: undecoded(f) for name, f in feature.items()})
    if isinstance(feature, (list, tuple)):
        return type(feature)(undecoded(f) for f in feature)
    if hasattr(feature, "feature"):  # a List's items
        return dataclasses.replace(feature, feature=undecoded(feature.feature))
    if getattr(feature, "decode", False) and type(feature).__name__ != "Json":  # (Json's decoding is json.loads)
        return dataclasses.replace(feature, decode=False)
    return feature


def read_rows(rows, field, chat):  # a Hugging Face dataset's or a parquet file's
    for row, record in enumerate(rows, 1):
        if isinstance(record, dict) and not field:  # Arrow gives each message every key any message has: None
            record = {key: without_nulls(value) for key, value in record.items()}  # where it had none, as in JSON
        yield f"row {row}", *record_text(record, field, chat)


def without_nulls(value):
    # value with its dicts' keys whose value is None dropped, however deep, but a message's content
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None or k == "content"}
    return value


def input_files(folder, stats, skip, only_py=False, exclude=frozenset(), rel_folder=""):
    """Yield (path, path within the INPUT) per file under folder (or folder, a file), sorted, but those under a resolved
    path in exclude (the dataset being written, --val_input's); skip(path, why) for a link or folder it can't follow."""
    if isinstance(folder, HubSplit):
        yield folder, str(folder)
        return
    folder = Path(folder)
    if not folder.is_dir():
        yield folder, folder.name
        return
    try:
        entries = sorted(os.scandir(folder), key=lambda entry: entry.name)
    except OSError as e:
        skip(folder, f"unreadable folder: {e.strerror}")
        return
    for entry in entries:
        path, rel = Path(entry.path), f"{rel_folder}{entry.name}"
        try:  # a symlink to a file is read; one to a folder, broken or looping, is listed as skipped
            to_folder = entry.is_symlink() and stat.S_ISDIR(os.stat(path).st_mode)
            why = "symlink to a folder, not followed (pass it as an INPUT)" if to_folder else None
        except OSError as e:
            why = "symlink loop" if e.errno == errno.ELOOP else "broken symlink"
        if entry.name.startswith("."):
            stats["hidden_skipped"] += 1  # .git, .venv, .DS_Store: counted, not listed
        elif why:
            skip(path, why)
        elif entry.is_dir(follow_symlinks=False):
            # installed packages are not the stdlib
            if not (only_py and entry.name == "site-packages") and path.resolve() not in exclude:
                yield from input_files(path, stats, skip, only_py, exclude, rel + "/")
        elif not only_py or entry.name.endswith(".py"):
            # a --val_input file met here is left out (resolved only if a link or named as one of them)
            if not (entry.is_symlink() or any(entry.name == p.name for p in exclude)) or path.resolve() not in exclude:
                yield path, rel


def shown(path):
    # a path as text that meta.json and the report can hold: a name that isn't UTF-8 keeps its bytes as \xNN
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


def file_ext(path):
    """'.jsonl.gz' -> '.jsonl.gz', 'README' -> '' (for the per-extension report)."""
    if isinstance(path, HubSplit):
        return "(hf dataset)"
    name = path.name.lower()
    return Path(name.removesuffix(".gz")).suffix + (".gz" if name.endswith(".gz") else "")


def record_text(obj, field, chat):
    """JSON record -> (text, None), (Chat, None) for a conversation (chat: the ChatFormat's maker), or (None, why)."""
    if not isinstance(obj, dict):
        return None, f"not a JSON object ({type(obj).__name__})"
    if not field and is_conversation(obj):
        chat_format = chat()  # a template that cannot be used stops the run (UserError): no record is to blame
        try:
            chat = chat_format.record(obj)
            chat.text.encode("utf-8")  # a lone surrogate (\ud83d in JSON) no tokenizer can read
            return chat, None
        except UnicodeEncodeError:
            return None, "invalid unicode (lone surrogate)"
        except ValueError as e:
            return None, str(e)
    names = [field] if field else TEXT_FIELDS
    name = next((key for key in names if key in obj), None)
    text = obj.get(name)
    if name is None:  # a shape of its own: what it has, and what would have been read
        wanted = "" if field else (", or a conversation: messages, conversations, prompt+completion, "
                                   "instruction+output")
        keys = ", ".join(map(str, obj))[:120] or "none"
        return None, f"no text field ({'/'.join(names)}{wanted}); it has {keys}"
    if not isinstance(text, str):
        return None, f"field '{name}' is not a string ({type(text).__name__})"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # from a JSON \ud800 escape
        return None, "invalid unicode (lone surrogate)"
    return text, None


def read_documents(path, field, dedup, chat):
    """Yield (position, str, BigText or Chat, None), or (position, None, why) per bad record; SkipFile if unreadable."""
    ext = file_ext(path).removesuffix(".gz")
    if isinstance(path, HubSplit):
        yield from read_rows(hub_rows(path, field), field, chat)
    elif not path.is_file():
        raise SkipFile("not a regular file")
    elif ext in (".jsonl", ".ndjson"):
        with open_input(path) as f:
            for n, line in enumerate(bounded_lines(f, MAX_RECORD), 1):  # bytes: split on \n only, as JSON Lines
                if line is None:
                    yield str(n), None, f"a record over {MAX_RECORD >> 20} MB (split it)"
                    continue
                if n == 1 and line.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    raise SkipFile("UTF-16 text (convert it to UTF-8)")
                if n == 1:
                    refuse_packed(path, line)
                line = line.removeprefix(codecs.BOM_UTF8)  # (files joined by cat: a BOM at each one's first line)
                if not line.strip():
                    continue
                why = None
                try:
                    record = json.loads(line.decode("utf-8"))  # (json's own guess reads UTF-16 and UTF-32 too)
                except UnicodeDecodeError:
                    why = "not UTF-8"
                except ValueError as e:
                    why = f"malformed JSON ({getattr(e, 'msg', e)})"
                except RecursionError:  # json's parser recurses once per level
                    why = "JSON nested too deeply"
                yield str(n), *(record_text(record, field, chat) if why is None else (None, why))
    elif ext == ".parquet":
        yield from read_parquet(path, field, chat)
    elif ext in (".csv", ".tsv"):
        yield from read_csv(path, field, chat, ext)
    elif ext == ".json":  # read whole: its records in memory at once, ~15 times its size, so at most MAX_JSON
        texts, size = [], 0
        for data, text in decoded(path):
            size += len(data)
            if size > MAX_JSON:
                raise SkipFile(f"a .json over {MAX_JSON >> 20} MB, which is read whole: make it JSON Lines (.jsonl, a "
                               f"record a line, read one at a time)")
            texts.append(text)
        try:
            obj = json.loads("".join(texts))
        except json.JSONDecodeError as e:  # (records a line each, as the datasets library reads a .json: .jsonl)
            lines = " (JSON Lines? name it .jsonl)" if e.msg == "Extra data" and e.colno == 1 else ""
            raise SkipFile(f"malformed JSON ({e.msg} at line {e.lineno} column {e.colno}){lines}")
        except ValueError as e:  # an integer past Python's 4,300 digits
            raise SkipFile(f"malformed JSON ({e})")
        except RecursionError:
            raise SkipFile("JSON nested too deeply")
        for i, item in enumerate(obj, 1) if isinstance(obj, list) else [(0, obj)]:
            yield (f"item {i}" if i else ""), *record_text(item, field, chat)
    else:
        yield "", read_text(path, dedup), None


def bounded_lines(f, limit):
    """Yield a binary file's lines of at most limit bytes, None for each longer one (read past, never held)."""
    while line := f.readline(limit + 1):
        if len(line) <= limit:
            yield line
            continue
        while not line.endswith(b"\n") and (line := f.readline(PIECE)):  # the rest of it, a piece at a time
            pass
        yield None


def read_csv(path, field, chat, ext):
    # a header row, then a record a row (a quoted field may span lines), read a line at a time, up to MAX_RECORD bytes
    def lines(f):
        for n, line in enumerate(bounded_lines(f, MAX_RECORD), 1):
            record[0] += len(line or b"")
            if line is None or record[0] > MAX_RECORD:
                raise SkipFile(f"a record over {MAX_RECORD >> 20} MB at line {n}")
            if n == 1:
                refuse_packed(path, line)
            yield line.decode("utf-8-sig" if n == 1 else "utf-8")

    record = [0]  # the bytes of the record being read
    limit = csv.field_size_limit(MAX_RECORD)  # (the csv module's, for every caller: put back after)
    with open_input(path) as f, contextlib.ExitStack() as stack:
        stack.callback(csv.field_size_limit, limit)
        # .csv strictly: a stray quote is an error, not records run together. A .tsv has no quoting (IANA's, and
        # GLUE's files): a line a record, its quotes text
        if ext == ".tsv":
            rows = csv.DictReader(lines(f), dialect="excel-tab", quoting=csv.QUOTE_NONE)
        else:
            rows = csv.DictReader(lines(f), dialect="excel", strict=True)
        try:
            seen = set()  # a name the header gives twice: a row would keep one of its columns alone
            if twice := next((n for n in rows.fieldnames or [] if n in seen or seen.add(n)), None):
                raise SkipFile(f"its header names the column {twice!r} twice")
            for row in rows:
                record[0] = 0
                if None in row:  # more fields than the header names: where the text ends is unknown
                    yield f"line {rows.line_num}", None, f"{len(row) - 1 + len(row[None])} fields, the header " \
                                                        f"names {len(rows.fieldnames)}"
                    continue
                yield f"line {rows.line_num}", *record_text(row, field, chat)
        except (csv.Error, UnicodeDecodeError) as e:
            raise SkipFile(f"not a readable {ext[1:]} file: the record at line {rows.line_num + 1} ({str(e)[:80]})")


def read_parquet(path, field, chat):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise SkipFile("needs pyarrow (pip install pyarrow)")
    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise SkipFile(f"not a readable parquet file ({first_line(e)})")
    names = parquet.schema_arrow.names
    if not field and is_conversation(dict.fromkeys(names)):  # conversations: each row as a record
        yield from read_rows(parquet_values(parquet.iter_batches(batch_size=batch_rows(parquet)), True), None, chat)
        return
    column = field or next((c for c in TEXT_FIELDS if c in names), None)
    if column not in names:
        raise SkipFile(f"no text column ({field or '/'.join(TEXT_FIELDS)}); it has {', '.join(names)[:80]}")
    kind = parquet.schema_arrow.field(column).type
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind  # pandas' category: its values
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise SkipFile(f"column '{column}' holds {kind}, not text")
    batches = parquet.iter_batches(columns=[column], batch_size=batch_rows(parquet))  # streams, a batch at a time
    for row, text in enumerate(parquet_values(batches, False), 1):
        yield f"row {row}", text, None if text is not None else f"'{column}' is null"


def batch_rows(parquet):
    # rows a record batch of about PIECE * 64 bytes holds (1,024 at most), by the largest rows of its row groups (rows
    # of 240 KB had made batches of 240 MB); a row group's column is read whole all the same
    groups = [parquet.metadata.row_group(i) for i in range(parquet.metadata.num_row_groups)]
    per_row = max([g.total_byte_size / g.num_rows for g in groups if g.num_rows] or [1])
    return max(1, min(1024, int(PIECE * 64 / per_row)))


def parquet_values(batches, rows):
    # the rows of batches as records (rows), else their one column's values; SkipFile from a value that is not UTF-8
    # (a parquet string may hold any bytes) on, as for a text file
    import pyarrow as pa
    try:
        for batch in batches:
            yield from batch.to_pylist() if rows else batch.column(0).to_pylist()
    except UnicodeDecodeError as e:
        raise SkipFile(f"not UTF-8 (byte 0x{e.object[e.start]:02x} in a value)") from None
    except (pa.ArrowException, OSError) as e:  # a damaged file (pyarrow's OSError, ArrowInvalid), read so far
        raise SkipFile(f"unreadable ({first_line(e)})") from None


def refuse_packed(path, head):
    """SkipFile where a file's first bytes (head) say it is compressed otherwise than its name says."""
    packed = next((kind for magic, kind in COMPRESSED.items() if head.startswith(magic)), None)
    if packed and (packed != "bzip2" or head[4:10] in (b"1AY&SY", b"\x17rE8P")):  # (a text may begin "BZh")
        misnamed = packed == "gzip" and not path.name.lower().endswith(".gz")
        raise SkipFile(f"{packed}-compressed ({'name it .gz' if misnamed else 'decompress it'} to have it "
                       f"read{'; a .docx or .epub is a zip of XML: save its text' if packed == 'zip' else ''})")


def decoded(path):
    """Yield (bytes, text) per PIECE bytes of a UTF-8 file (gunzipped, BOM dropped); SkipFile at NUL or bad UTF-8."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0  # a character may span two reads
    with open_input(path) as f:
        while True:
            data = f.read(PIECE)
            if offset == 0 and data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                raise SkipFile("UTF-16 text (convert it to UTF-8)")
            if offset == 0:
                refuse_packed(path, data)
            if offset == 0 and data.startswith(codecs.BOM_UTF8):
                data, offset = data[3:], 3
            if b"\0" in data:
                raise SkipFile("binary (contains NUL bytes)")
            first_byte = offset - len(decoder.getstate()[0])  # the decoder holds a cut character's bytes
            try:
                text = decoder.decode(data, final=not data)  # from bytes: line endings stay as they are
            except UnicodeDecodeError as e:
                raise SkipFile(f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {first_byte + e.start})")
            if not data:
                return
            yield data, text
            offset += len(data)


def read_text(path, dedup):
    """A text file: its text if one read holds it, else a BigText checked whole (a late bad byte skips it unused)."""
    first, n, nchars, blank = "", 0, 0, True
    digest = blake2b(digest_size=16) if dedup else None
    for n, (data, text) in enumerate(decoded(path), 1):
        first = text  # the whole text if there is one read
        nchars += len(text)
        blank = blank and (not text or text.isspace())
        if digest:
            digest.update(data)
    return first if n <= 1 else BigText(path, nchars, blank, digest and digest.digest())


def pieces(doc, start=0, stop=None, in_one_piece=False, stats=None):
    """Yield (text, is_last) for characters start:stop of a document: a str whole, a BigText in pieces of about a read,
    cut at its last SAFE_CUT (none: held until one comes) unless in_one_piece; all cut at HARD_CUT held (counted)."""
    if isinstance(doc, (str, Chat)):  # a conversation is always whole
        yield doc[start:stop] if isinstance(doc, str) else doc, True
        return
    held, at = [], 0  # text read but not yet given out; characters read
    try:
        for _, text in decoded(doc.path):
            read_from, at = at, at + len(text)
            if at <= start:
                continue
            text = text[max(start - read_from, 0):None if stop is None else max(stop - read_from, 0)]
            cut = None if in_one_piece else LAST_CUT.match(text)
            if cut:  # 0 < cut.end() < len(text): SAFE_CUT looks one character back and one ahead
                yield "".join(held) + text[:cut.end()], False
                held = [text[cut.end():]]
            else:
                held.append(text)
            if sum(map(len, held)) >= HARD_CUT:  # before its last space: a piece that begins with one is not given
                text = "".join(held)  # another by a tokenizer that puts a space before a text's first word
                end = text.rfind(" ", 1)
                end = end if end > 0 else len(text)
                yield text[:end], False
                held = [text[end:]]
                if stats is not None:
                    stats["hard_cuts"] += 1
            if stop is not None and at >= stop:
                break
    except (SkipFile, OSError, EOFError, zlib.error) as e:  # it was whole when read_text checked it
        raise UserError(f"{doc.path} changed while it was read ({e}); run again") from None
    if stop is None and at != doc.nchars:  # read to its end: longer or shorter than read_text counted
        raise UserError(f"{doc.path} changed while it was read ({doc.nchars:,} characters, then {at:,}); run again")
    yield "".join(held), True


def new_stats():
    """What was read and skipped, in meta.json's own words and order (meta.json takes it whole)."""
    return {"files_read": 0, "extensions": {}, "files_skipped": 0, "skipped_files": [], "hidden_skipped": 0,
            "bad_records": {"count": 0, "examples": []}, "empty_documents": 0, "duplicates_dropped": 0,
            "short_dropped": 0,  # documents of fewer tokens than --min_length
            "hard_cuts": 0,  # places text was cut off a safe cut, none being within HARD_CUT characters
            "unknown_tokens": 0,  # tokens that stand for text the tokenizer cannot spell (a tokenizer.json's [UNK])
            "conversations": None}  # whether the documents are conversations: the first one decides


def ext_stats(stats, ext):
    return stats["extensions"].setdefault(ext or "(none)", {"files": 0, "documents": 0, "bytes": 0, "tokens": 0})


def file_id(path):
    # what names one file whatever its path (a link, a hard link): corpus reads each once
    st = os.stat(path)
    return "file", st.st_dev, st.st_ino


def val_files(val_inputs):
    """file_id of every file under val_inputs: prepare.py's training pass leaves them out, whatever names them."""
    return {file_id(p) for root in val_inputs for p, _ in input_files(root, new_stats(), lambda *_: None)
            if isinstance(p, Path) and p.is_file()}


def rejected(stats, strict, where, why, whole_file):
    # a file or a record left out, in stats: counted, and the first MAX_EXAMPLES listed (a folder of 650K images:
    # a 64 MB meta.json); strict: UserError instead
    if strict:
        raise UserError(f"{where}: {why} (fix or remove it, or run without --strict to skip it)")
    if whole_file:
        stats["files_skipped"] += 1
        if len(stats["skipped_files"]) < MAX_EXAMPLES:
            stats["skipped_files"].append({"path": where, "reason": why})
        return
    stats["bad_records"]["count"] += 1
    if len(stats["bad_records"]["examples"]) < MAX_EXAMPLES:
        stats["bad_records"]["examples"].append(f"{where}: {why}")


def corpus(inputs, args, stats, only_py=False, exclude=frozenset(), seen=None):
    """Yield (key, ext, doc: a str, BigText or Chat) per accepted document of inputs, in a fixed order; key (path in
    its INPUT:position) names it for the split. seen: digests of the documents kept before (--dedup) and the file_id
    of each file read (prepare.py's training pass finds --val_input's there too), added to."""
    seen = set() if seen is None else seen
    counts = {"kept": 0, "conversations left": 0, "first": None}  # (a text read first decides against conversations)
    reject = partial(rejected, stats, args.strict)
    for root in inputs:
        for path, rel in input_files(root, stats, lambda path, why: reject(shown(path), why, True), only_py, exclude):
            ext, kept, where = file_ext(path), 0, shown(path)
            try:
                if not isinstance(path, HubSplit) and path.is_file():  # (seen is shared by the two splits' calls)
                    if (same := file_id(path)) in seen:
                        raise SkipFile("another name (a link) for a file read once, here or as --val_input's")
                    seen.add(same)
                for pos, doc, why in read_documents(path, args.field, args.dedup, args.chat):
                    chat = isinstance(doc, Chat)
                    if why is None and stats["conversations"] not in (None, chat):
                        why = "a conversation among texts" if chat else "a text among conversations"
                        why += " (prepare the two kinds apart)"
                        counts["conversations left"] += chat
                        if not pos:  # a plain-text file among conversations
                            raise SkipFile(why)
                    if why is not None:
                        reject(f"{where}:{pos}" if pos else where, why, whole_file=False)
                        continue
                    big = isinstance(doc, BigText)
                    text = doc.text if chat else doc
                    if doc.blank if big else not text.strip():
                        stats["empty_documents"] += 1  # empty or whitespace only: nothing to learn from
                        continue
                    if args.dedup:
                        digest = doc.digest if big else blake2b(text.encode("utf-8"), digest_size=16).digest()
                        if digest in seen:
                            stats["duplicates_dropped"] += 1
                            continue
                        seen.add(digest)
                    if stats["conversations"] is None:  # the document that decides the kind (here, not a pass before)
                        counts["first"] = f"{where}:{pos}" if pos else where
                    stats["conversations"] = chat
                    kept += 1
                    counts["kept"] += 1
                    yield f"{rel}:{pos}", ext, doc
            except (SkipFile, OSError, EOFError, zlib.error) as e:  # SkipFile; permissions, broken links, corrupt gzip
                why = str(e) if isinstance(e, SkipFile) else f"unreadable ({getattr(e, 'strerror', None) or e})"
                why = {errno.ELOOP: "symlink loop", errno.ENOENT: "broken symlink"}.get(getattr(e, "errno", None), why)
                reject(where, f"{why} after {kept} documents (those are kept)" if kept else why, whole_file=True)
            else:
                stats["files_read"] += 1
                ext_stats(stats, ext)["files"] += 1
    if counts["conversations left"] > counts["kept"]:  # (a README.md read first made a folder of conversations texts)
        first = f"{counts['first']}, read first," if counts["first"] else "the training inputs, read first,"
        fix = f"leave {counts['first']} out" if counts["first"] else "--val_input holds conversations"
        raise UserError(f"{first} made this a dataset of texts, and {counts['conversations left']:,} conversations "
                        f"were left out, more than the {counts['kept']:,} texts kept: prepare the two kinds apart "
                        f"({fix})")
