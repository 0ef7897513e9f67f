"""
Every tokenizer prepare.py makes or reads as one Tokenizer: tiktoken's encodings, char (a corpus's characters), bpe:N
(byte-level BPE learned by rustbpe), wordpiece:N, a Hugging Face tokenizer.json, nanoGPT's character datasets
(meta.pkl); a dataset's own (load_tokenizer), and whether it is another folder's (check_tokenizer).

    from lib.tokenizer import load_tokenizer, make_tokenizer
    tokenizer = load_tokenizer("data/stdlib")
    print(tokenizer.decode(tokenizer.encode("import os")))
    tokenizer = make_tokenizer("cl100k_base", None)
"""

import atexit
import base64
import json
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path

import numpy as np

from lib.bounds import check_tokenizer_rules, confined
from lib.files import MAX_VOCAB, UserError, check_json_size, nanogpt_chars, open_own, refuse_unfinished

# a tokenizers call's deadline: 5 s, and 100 us a character (released tokenizers take ~1 us a character)
ENCODE_DEADLINE = (5.0, 1e-4)
CALLS = {}  # the calls under way: (when due, tokenizer's name, characters, seconds allowed) (deadline)
WATCHER = []  # deadline's thread, once started (a forked worker's copy is not alive: it starts its own)
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # Hugging Face's, preferred first


class Tokenizer:
    """Exactly one of enc (tiktoken's, for tiktoken and bpe), chars and hf does the encoding."""

    def __init__(self, kind, name, vocab_size, eot_id, enc=None, chars=None, hf=None,
                 hf_json=None, ranks=None, pattern=None, bos_id=None, unk_id=None):
        self.kind, self.name = kind, name  # kind: tiktoken | bpe | char | nanogpt_char | huggingface
        self.vocab_size, self.eot_id = vocab_size, eot_id  # eot_id None: nanoGPT's characters have none
        self.bos_id = bos_id  # what a tokenizer.json's post-processor puts before a text (Llama 3's), or None
        self.unk_id = unk_id  # what a tokenizer.json writes for text it cannot spell ([UNK], <unk>), or None
        self.enc, self.chars, self.hf = enc, chars, hf
        self.hf_json, self.ranks, self.pattern = hf_json, ranks, pattern  # what save() writes
        if chars is not None:  # np.searchsorted needs the code points sorted; ids keep the given order
            codes = np.array([ord(c) for c in chars], dtype=np.uint32)
            self.code_ids = np.argsort(codes, kind="stable").astype(np.uint32)
            self.codes = codes[self.code_ids]

    def encode(self, text, bos=False):
        """str -> list[int], without end-of-text; bos: with the BOS (bos_id) first, as a document and a prompt begin."""
        return self.encode_docs([text], [False], [bos])[0].tolist()

    def decode(self, ids):
        """list[int] -> str; end-of-text decodes to <|endoftext|> (or the tokenizer's own)."""
        ids = [int(i) for i in ids]
        if self.enc is not None:
            return self.enc.decode(ids)
        if self.chars is not None:  # an id past the characters is our end-of-text; nanoGPT's have none
            beyond = "<|endoftext|>" if self.eot_id is not None else "\ufffd"
            return "".join(self.chars[i] if i < len(self.chars) else beyond for i in ids)
        return self.hf.decode(ids, skip_special_tokens=False)

    def encode_docs(self, texts, ends, starts):
        """list[str] -> each text's ids (uint32), after the BOS (bos_id) where starts[i] (a document's first piece),
        then end-of-text where ends[i] (its last). Thread-safe; tiktoken and HF release the GIL: threads run at once."""
        if self.enc is not None:  # encode_to_numpy with nothing special is encode_ordinary, minus the list
            out = [self.enc.encode_to_numpy(text, disallowed_special=()) for text in texts]
        elif self.chars is not None:
            out = [self.encode_chars(text) for text in texts]
        else:
            with stopped_in_one_line(self.name, sum(map(len, texts))):
                encodings = self.hf.encode_batch(texts, add_special_tokens=False)
            out = [np.array(encoding.ids, dtype=np.uint32) for encoding in encodings]
        if self.bos_id is not None:  # a document begins as AutoTokenizer begins it
            bos = np.array([self.bos_id], dtype=np.uint32)
            out = [np.concatenate([bos, ids]) if start else ids for ids, start in zip(out, starts)]
        if not any(ends):
            return out
        if self.eot_id is None:
            raise UserError(f"tokenizer {self.name} has no end-of-text token to end documents with")
        eot = np.array([self.eot_id], dtype=np.uint32)
        return [np.concatenate([ids, eot]) if end else ids for ids, end in zip(out, ends)]

    def special_tokens(self):
        """{text: id} of the tokens a chat template writes as markers (<|im_end|>, <|endoftext|>, ...)."""
        if self.enc is not None:
            return {token: self.enc.encode_single_token(token) for token in self.enc.special_tokens_set}
        if self.hf is not None:
            added = json.loads(self.hf_json).get("added_tokens", [])
            return {t["content"]: t["id"] for t in added if t.get("special")}
        return {}

    def encode_chat(self, text, spans):
        """A chat template's text -> (ids, mask): its markers read as special tokens, and mask 1 for each token
        that overlaps a trained span of characters [(start, end)], 0 elsewhere (uint32 and uint8 arrays)."""
        if self.enc is not None:
            ids = self.enc.encode(text, allowed_special="all")
            starts = self.enc.decode_with_offsets(ids)[1]
        elif self.hf is not None:
            if getattr(self, "hf_chat", None) is None:  # a second encoder that reads "<|im_end|>" as the token
                self.hf_chat = hf_encoder(self.hf_json)
            with stopped_in_one_line(self.name, len(text)):
                encoding = self.hf_chat.encode(text, add_special_tokens=False)
            ids, starts = encoding.ids, [start for start, _ in encoding.offsets]
            said = [end for _, end in encoding.offsets]  # WordPiece's leave out the spaces between tokens
        else:
            raise UserError(f"a {self.kind} tokenizer has no special tokens for a chat template: use bpe:N, "
                             f"a tiktoken encoding or a model's tokenizer.json")
        starts = np.array(starts, dtype=np.int64)
        # a token ends where its offsets say (tiktoken's: where the next begins), a character at least after it
        # begins: an emoji's byte tokens all begin where it does
        ends = np.array(said, dtype=np.int64) if self.enc is None else np.append(starts[1:], len(text))
        ends = np.maximum(ends, starts + 1)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in spans:  # a token overlapping the span is trained: " Hello" whose space is outside it
            mask[(starts < end) & (ends > start)] = 1
        return np.array(ids, dtype=np.uint32), mask

    def encode_chars(self, text):
        code_points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        at = np.searchsorted(self.codes, code_points)
        unknown = self.codes[np.minimum(at, len(self.codes) - 1)] != code_points
        if unknown.any():
            raise UserError(f"character {chr(code_points[unknown.argmax()])!r} is not in the vocabulary "
                            f"(use a tokenizer that covers this text)")
        return self.code_ids[at]

    def save(self, out_dir):
        """Write what load_tokenizer needs into out_dir (under a .tmp name) -> (meta's entry, file name)."""
        if self.kind == "tiktoken":
            return {"kind": "tiktoken", "name": self.name}, None
        if self.kind == "huggingface":
            name, data = "tokenizer.json", self.hf_json
        elif self.kind == "char":
            name, data = "vocab.json", json.dumps({"kind": "char", "chars": self.chars})
        elif self.kind == "bpe":  # the ranks in order; byte-level, so each token is a base64 byte string
            ranks = [base64.b64encode(token).decode() for token in sorted(self.ranks, key=self.ranks.get)]
            name, data = "vocab.json", json.dumps({"kind": "bpe", "pattern": self.pattern, "ranks": ranks})
        else:  # nanoGPT's characters have no end-of-text, so no dataset of ours is made with them
            raise UserError(f"a {self.kind} tokenizer is not saved with a dataset")
        with open_own(Path(out_dir) / (name + ".tmp"), "w", encoding="utf-8") as f:
            f.write(data)
        return {"kind": self.kind, "name": self.name, "file": name}, name


@contextmanager
def stopped_in_one_line(name, chars=None):
    """A Rust panic in the tokenizers library (a BaseException, with a traceback), or an error of its own (a plain
    Exception: a WordPiece without its [UNK]), as one line naming the tokenizer; and a call on chars characters past
    its deadline stopped (deadline; none without chars)."""
    try:
        with deadline(name, chars) if chars is not None else nullcontext():
            yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except Exception as e:
        if type(e) is not Exception:  # ours (UserError), Python's own
            raise
        raise UserError(f"tokenizer {name} failed on a text ({str(e)[:160]}): use the model's own "
                        f"tokenizer.json") from None
    except BaseException as e:
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(f"tokenizer {name} failed on a document ({type(e).__name__}: {why}): its normalizer or "
                        f"pre-tokenizer rules are at fault; use the model's own tokenizer.json") from None


@contextmanager
def deadline(name, chars):
    """A tokenizers call on chars characters past ENCODE_DEADLINE (a regex that backtracks, which check_linear's
    probes can miss, takes hours) stops the process with one line, exit status 1: the library cannot be interrupted,
    and what a script writes is under .tmp names until it is whole. One thread (watch) keeps every call's time."""
    seconds = ENCODE_DEADLINE[0] + ENCODE_DEADLINE[1] * chars
    call = object()
    CALLS[call] = (time.monotonic() + seconds, name, chars, seconds)
    if not (WATCHER and WATCHER[-1].is_alive()):
        WATCHER.append(threading.Thread(target=watch, name="tokenizer deadlines", daemon=True))
        WATCHER[-1].start()
    try:
        yield
    finally:
        del CALLS[call]


def watch():
    # deadline's thread: twice a second, whether a call is past its time
    while True:
        time.sleep(0.5)
        late = [(name, chars, seconds) for due, name, chars, seconds in list(CALLS.values()) if time.monotonic() > due]
        if late:
            past_deadline(*late[0])


def past_deadline(name, chars, seconds):
    # from watch: what was printed before, the line, what waits for exit, and exit
    with suppress(Exception):
        sys.stdout.flush()
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    os.write(2, f"{script}: tokenizer {name} took more than {seconds:.0f} s on {chars:,} characters: its rules (a "
                f"regex that backtracks) would take hours on this text; use the model's own tokenizer.json\n"
                .encode())
    atexit._run_exitfuncs()  # what a script leaves to exit: its .tmp files, its folder's lock (prepare.py, train.py)
    os._exit(1)


def tiktoken_tokenizer(name):
    import tiktoken
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # it downloads on first use
        raise UserError(f"cannot load tiktoken encoding '{name}' ({type(e).__name__}); it downloads on first use: "
                        f"go online once or set TIKTOKEN_CACHE_DIR to a folder holding it") from None
    return Tokenizer("tiktoken", name, enc.n_vocab, enc.eot_token, enc=enc)


def bpe_tokenizer(name, ranks, pattern):
    """Our byte-level BPE (rustbpe's ranks), run by tiktoken, with <|endoftext|> after the ranks."""
    import tiktoken
    enc = tiktoken.Encoding(name, pat_str=pattern, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": len(ranks)})
    return Tokenizer("bpe", name, enc.n_vocab, enc.eot_token, enc=enc, ranks=ranks, pattern=pattern)


def char_tokenizer(chars, kind="char"):
    """chars in id order. Ours (char) ends documents with one more id; nanoGPT's (nanogpt_char) has none."""
    eot_id = len(chars) if kind == "char" else None
    return Tokenizer(kind, kind, len(chars) + (eot_id is not None), eot_id, chars=chars)


def hf_encoder(hf_json):
    # tokenizers' Tokenizer of hf_json, without the truncation or padding a file may be saved with: they would cut or
    # pad every document (transformers turns them off too, unless a call asks for them)
    from tokenizers import Tokenizer as HFTokenizer
    hf = HFTokenizer.from_str(hf_json)
    hf.no_truncation()
    hf.no_padding()
    return hf


def hf_tokenizer(name, hf_json):
    try:
        import tokenizers  # noqa: F401 (hf_encoder's)
    except ImportError:
        raise UserError("a tokenizer.json needs the tokenizers library (pip install tokenizers)") from None
    spec = json.loads(hf_json)
    check_tokenizer_rules(name, spec)  # its normalizer's growth and its regexes, before any text
    # an id past any vocabulary (the library would size a table by it; train.py would refuse the dataset made with it)
    listed = spec.get("model").get("vocab") if isinstance(spec.get("model"), dict) else None
    ids = [*(listed.values() if isinstance(listed, dict) else []),
           *(t.get("id") for t in spec.get("added_tokens") or [] if isinstance(t, dict))]
    if (top := max((i for i in ids if type(i) is int), default=0)) >= MAX_VOCAB:
        raise UserError(f"tokenizer {name} has the id {top:,}, past {MAX_VOCAB:,}, more than any tokenizer has: use "
                        f"the model's own tokenizer.json")
    if isinstance(spec.get("model"), dict) and spec["model"].get("dropout"):  # (training-time BPE-dropout)
        raise UserError(f"tokenizer {name} has BPE dropout {spec['model']['dropout']}: it spells a text another way "
                        f"each time, and the data would not be the text's tokens; set its model's dropout to null")
    hf = hf_encoder(hf_json)
    hf.encode_special_tokens = True  # a literal "</s>" in a document is text, not a token
    vocab = hf.get_vocab(with_added_tokens=True)
    eot_id = next((vocab[t] for t in EOT_NAMES if t in vocab), None)
    if eot_id is None:
        raise UserError(f"tokenizer {name} has none of the end-of-text tokens {', '.join(EOT_NAMES)} (add one to it)")
    # the BOS its post-processor puts before every text (Llama 3's), or None; prepare.py writes end-of-text itself
    with stopped_in_one_line(name):  # (check_linear's calls each have their deadline)
        plain = hf.encode("a", add_special_tokens=False).ids
        full = hf.encode("a", add_special_tokens=True).ids
        check_linear(name, hf)
    bos_id = full[0] if len(full) > len(plain) and full[1:1 + len(plain)] == plain else None
    model = spec["model"] if isinstance(spec.get("model"), dict) else {}  # unk_token: BPE's, WordPiece's; Unigram's id
    unk, unk_id = model.get("unk_token"), model.get("unk_id")
    unk_id = vocab.get(unk) if isinstance(unk, str) else unk_id if type(unk_id) is int else None
    return Tokenizer("huggingface", name, max(vocab.values()) + 1, eot_id, hf=hf, hf_json=hf_json, bos_id=bos_id,
                     unk_id=unk_id)


def check_linear(name, hf):
    """UserError where hf (tokenizers') takes time past linear in a run of one character: a regex that backtracks
    ([a-z]*[a-z]*\\d on letters: cubic) that bounds.nested_repeat does not see would take hours on a long document.
    4 times the text takes ~3-4 times as long in every released tokenizer (~0.2 ms for 1,000 characters)."""
    def seconds(text, tries):  # the fewest of tries: a process preempted once is not the tokenizer's time
        fewest = float("inf")
        for _ in range(tries):
            began = time.perf_counter()
            with deadline(name, len(text)):
                hf.encode(text, add_special_tokens=False)
            fewest = min(fewest, time.perf_counter() - began)
        return fewest
    for char in "aA1 .\n\u00e9\u4e2d":
        try:
            short, long = seconds(char * 250, 1), seconds(char * 1000, 1)
        except Exception:  # (the library's own: a character it cannot spell, without an [UNK]) not the time asked
            continue
        if long > 0.02 and long > 8 * short:  # (measured again where it looks so)
            short, long = seconds(char * 250, 3), seconds(char * 1000, 3)
            if long > 0.02 and long > 8 * short:
                raise UserError(f"tokenizer {name} takes {long:.2f} s on {char * 3!r}... of 1,000 characters, "
                                f"{long / short:.0f} times its time on 250: its rules (a regex that backtracks, a "
                                f"WordPiece's max_input_chars_per_word) would take hours on a long document; use "
                                f"the model's own tokenizer.json")


def bases_tokenizer(tokenizer, base):
    """Whether tokenizer is the tokenizer.json of base, the run's Hugging Face folder, so its template holds too."""
    if tokenizer.kind != "huggingface" or not base:
        return False
    path, ours = os.path.join(base, "tokenizer.json"), tokenizer.hf_json.encode("utf-8")
    with suppress(OSError):  # read only a regular file of our own one's size: a FIFO or a huge file there is not it
        if os.path.isfile(path) and os.path.getsize(path) == len(ours):
            with open(path, "rb") as f:
                return f.read(len(ours) + 1) == ours
    return False


def wordpiece_tokenizer(name, size, texts):
    """A cased, BERT-style WordPiece of size tokens learned from texts(); decoding joins words with single spaces."""
    try:
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
    except ImportError:
        raise UserError("wordpiece:N needs the tokenizers library (pip install tokenizers)") from None
    learner = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    learner.normalizer = normalizers.BertNormalizer(lowercase=False)
    learner.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    learner.decoder = decoders.WordPiece()
    learner.train_from_iterator(texts(), trainers.WordPieceTrainer(
        vocab_size=size, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False))  # (its bars: blank lines)
    return hf_tokenizer(name, learner.to_str())


def make_tokenizer(spec, texts):
    """--tokenizer -> Tokenizer; texts() streams the corpus for the kinds that learn a vocabulary."""
    if spec == "char":
        chars = set()
        for text in texts():
            chars.update(text)
        return char_tokenizer("".join(sorted(chars)))
    if spec.startswith(("bpe:", "wordpiece:")):
        kind, size = spec.split(":", 1)
        least, example = (256, 4096) if kind == "bpe" else (100, 8192)
        if not (size.isascii() and size.isdigit()) or not least <= int(size) <= MAX_VOCAB:
            raise UserError(f"bad tokenizer '{spec}' ({kind}:N needs a whole number N from {least} to "
                            f"{MAX_VOCAB:,}, e.g. {kind}:{example})")
        if kind == "wordpiece":
            return wordpiece_tokenizer(spec, int(size), texts)
        import rustbpe
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(texts(), int(size))
        ranks = {bytes(b): rank for b, rank in trainer.get_mergeable_ranks()}
        return bpe_tokenizer(spec, ranks, trainer.get_pattern())
    import tiktoken
    if spec in tiktoken.list_encoding_names():
        return tiktoken_tokenizer(spec)
    path = Path(spec)
    if path.is_dir() and (path / "meta.json").exists():  # a prepared dataset: reuse its tokenizer
        try:
            return load_tokenizer(path)
        except ValueError as e:  # a damaged meta.json too
            raise UserError(str(e)) from None
    if path.is_dir() and not (path / "tokenizer.json").exists() and any(
            (path / name).exists() for name in ("meta.pkl", "train.bin", "val.bin")):
        raise UserError(f"{spec} is a nanoGPT dataset, whose tokenizer prepare.py does not reuse (its characters have "
                        f"no end-of-text to end documents with): use --tokenizer=char, or gpt2 for its GPT-2 tokens")
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        check_json_size(path, "use the model's own tokenizer.json")  # (read whole, and parsed)
        try:
            return hf_tokenizer(str(path), path.read_text(encoding="utf-8"))
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"cannot load {path} as a Hugging Face tokenizer.json "
                            f"({type(e).__name__}: {str(e)[:80]})") from None
    if path.exists() or "/" in spec or spec.endswith(".json"):
        raise UserError(f"no tokenizer.json at {spec} (check the path)")
    raise UserError(f"unknown tokenizer '{spec}' (use char, bpe:N, wordpiece:N, a path to a tokenizer.json or to "
                    f"a prepared dataset, or one of {', '.join(tiktoken.list_encoding_names())})")


def load_tokenizer(data_dir):
    """The tokenizer a dataset was made with: meta.json's, meta.pkl's characters, or GPT-2 with neither (as nanoGPT)."""
    refuse_unfinished(data_dir)
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").exists():
        if (data_dir / "meta.pkl").exists():
            return char_tokenizer("".join(nanogpt_chars(data_dir / "meta.pkl")), kind="nanogpt_char")
        return tiktoken_tokenizer("gpt2")
    try:
        spec = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))["tokenizer"]
        if spec.get("kind") not in ("tiktoken", "huggingface", "char", "bpe"):  # (a list's .get: AttributeError)
            raise TypeError(f"its kind is {spec.get('kind')!r}, not one prepare.py writes")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{data_dir / 'meta.json'} names no tokenizer as prepare.py writes it ({type(e).__name__}: "
                        f"{e}): re-run prepare.py") from None
    if spec["kind"] == "tiktoken":
        return tiktoken_tokenizer(spec["name"])
    path = confined(data_dir, spec.get("file"), data_dir / "meta.json")  # no /dev/zero, no ../elsewhere
    if not path.exists():
        raise UserError(f"{path} is missing, and meta.json needs it (re-run prepare.py)")
    check_json_size(path, "re-run prepare.py")
    try:
        data = path.read_text(encoding="utf-8")
        if spec["kind"] == "huggingface":
            return hf_tokenizer(spec["name"], data)
        data = json.loads(data)
        if spec["kind"] == "char":
            return char_tokenizer(data["chars"])
        ranks = {base64.b64decode(token): rank for rank, token in enumerate(data["ranks"])}
        return bpe_tokenizer(spec["name"], ranks, data["pattern"])
    except (UserError, KeyboardInterrupt):  # UserError: hf_tokenizer's own one line
        raise
    except BaseException as e:  # a pattern the regex engine refuses; the Rust libraries' panics are BaseExceptions
        why = (str(e).strip().splitlines() or [""])[0][:160]
        raise UserError(f"cannot read the tokenizer in {path} ({type(e).__name__}: {why}): re-run prepare.py") from None


def check_tokenizer(data_dir, meta, folder, model_vocab, fix=None):
    """UserError, in one line with the fix, unless dataset data_dir (meta: its read_meta) was made with folder's
    tokenizer (a Hugging Face model's of model_vocab ids, or a run's dataset's): the first documents must round-trip."""
    fix = fix or f"prepare it with the model's tokenizer: python prepare.py CORPUS --tokenizer={folder} --out_dir=DIR"
    if not any(os.path.exists(os.path.join(data_dir, name)) for name in ("meta.json", "meta.pkl", "val.bin")):
        raise UserError(f"{data_dir} holds no prepared dataset (no meta.json, meta.pkl or val.bin): {fix}")
    if meta["vocab_size"] > model_vocab:
        raise UserError(f"{data_dir} has {meta['vocab_size']} token ids, more than the {model_vocab} of {folder}: "
                         f"{fix}")
    dataset = any(os.path.exists(os.path.join(folder, name)) for name in ("meta.json", "meta.pkl", "val.bin"))
    if not dataset and not os.path.exists(os.path.join(folder, "tokenizer.json")):
        return  # nothing to compare with
    val = os.path.join(data_dir, "val.bin")
    if not os.path.isfile(val) or not os.path.getsize(val):  # no text to compare by (numpy maps no empty file)
        raise UserError(f"{val} is empty or missing, and it is how {data_dir}'s tokenizer is checked against "
                         f"{folder}'s: prepare the data with --val_fraction above 0 or --val_input")
    ids = np.array(np.memmap(val, dtype=np.dtype(meta["dtype"]), mode="r")[:4096], dtype=np.int64)
    ends = np.flatnonzero(ids == meta["eot_id"]) if meta.get("eot_id") is not None else np.array([], dtype=int)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(int)
    documents = [ids[a:b].tolist() for a, b in zip(starts, ends)][:8]  # whole ones, without end-of-text
    try:
        ours = load_tokenizer(data_dir)
        theirs = load_tokenizer(folder) if dataset else make_tokenizer(folder, None)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the tokenizer of {data_dir} to check it against {folder}'s "
                         f"({type(e).__name__}: {e}): {fix}") from None
    if ours.kind == theirs.kind == "huggingface" and ours.hf_json == theirs.hf_json:
        return  # the very same tokenizer.json (whose text need not round-trip: Mistral's decode drops a leading space)
    # conversations' markers (<|im_start|>, ...) read as special tokens; a text document's BOS is no text of it
    encode = (lambda text: theirs.encode_chat(text, [])[0].tolist()) if meta.get("masks") else \
        (lambda text: theirs.encode(text, bos=True))
    skip = 1 if ours.bos_id is not None and not meta.get("masks") else 0
    for doc in documents or [ids[:512].tolist()]:
        again = None
        with suppress(ValueError):  # a character the other vocabulary lacks, special tokens it has not
            again = encode(ours.decode(doc[skip:]))
        compared = len(doc) if documents else len(doc) - 64  # a cut document's last word may split otherwise
        if again is None or again[:compared] != doc[:compared]:
            raise UserError(f"{data_dir} was not prepared with the tokenizer of {folder}: {fix}")
