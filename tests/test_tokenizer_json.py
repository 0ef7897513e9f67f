"""tokenizer_json.py's tokenizer.json, written beside an exported model, gives, through
transformers' AutoTokenizer and through the tokenizers library, exactly the ids of the dataset's
own tokenizer, for tiktoken encodings, bpe:N, and a dataset made with a tokenizer.json.
Run: python -m pytest -q tests/test_tokenizer_json.py"""

import json
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from lib import tokenizer
from lib import tokenizer_json
transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402  (after the skip)

pytestmark = pytest.mark.slow  # tiktoken's big encodings, read whole
REPO = Path(__file__).resolve().parents[1]
TIKTOKEN_NAMES = ("gpt2", "cl100k_base", "o200k_base")

SAMPLES = [
    "",
    " ",
    "\n",
    "café naïve résumé Ångström Øre Straße ſ ǅ İstanbul e\u0301 Ελληνικά русский",
    "中文字符，日本語のテキスト、한국어 텍스트 ภาษาไทย العربية",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷 ✨\U0001F9EA",
    "3.14159265358979 1234567890123456789012 1,000,000 0x7fffffff 2026-11-22 ٣٤٥ ²³",
    "a  b   c    d\n\n\n  \n\t\t x \r\n y   \n \n\n    ",
    "don't I'LL we've THEY'RE she'd it's O'Neil 'quoted' '' ’s",
    "<|endoftext|> inside <|endoftext|><|endoftext|>a and at the end <|endoftext|>",
    "   leading spaces, trailing ones   ",
    "x" * 3000 + " " * 700 + "9" * 500,
]


def stdlib_text(size=300_000):
    """A few hundred KB of Python source, from files spread across the standard library."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    parts, total = [], 0
    for path in files[::25]:
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= size:
            break
    return "".join(parts)


@pytest.fixture(scope="module")
def corpus():
    return stdlib_text()


def tiktoken_case(name):
    import tiktoken
    try:
        tiktoken.get_encoding(name)
    except Exception as e:  # it would download: tests never do
        pytest.skip(f"tiktoken encoding {name} does not load offline ({type(e).__name__}); "
                    f"set TIKTOKEN_CACHE_DIR to a folder holding it")
    return tokenizer.tiktoken_tokenizer(name)


def bpe_case(tmp, corpus):
    """bpe:512 learned by prepare.py itself, read back as export.py will read it."""
    (tmp / "corpus.txt").write_text(corpus[:200_000], encoding="utf-8")
    run = subprocess.run([sys.executable, str(REPO / "prepare.py"), str(tmp / "corpus.txt"),
                          "--tokenizer=bpe:512", f"--out_dir={tmp / 'data'}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return tokenizer.load_tokenizer(tmp / "data")


def huggingface_case(tmp, corpus):
    """A tokenizer.json unlike ours: byte-level with its own regex, <s> and </s>, and a
    post-processor that puts <s> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([corpus[:100_000]], trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf.save(str(tmp / "tokenizer.json"))
    return tokenizer.make_tokenizer(str(tmp / "tokenizer.json"), lambda: iter(()))


@pytest.fixture(scope="module", params=[*TIKTOKEN_NAMES, "bpe", "huggingface"])
def exported(request, tmp_path_factory, corpus):
    """(our tokenizer, the files written, AutoTokenizer on them, tokenizers.Tokenizer on them)."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "bpe":
        ours = bpe_case(tmp, corpus)
    elif request.param == "huggingface":
        ours = huggingface_case(tmp, corpus)
    else:
        ours = tiktoken_case(request.param)
    files, note = tokenizer_json.hf_tokenizer_files(ours)
    assert note is None and sorted(files) == ["tokenizer.json", "tokenizer_config.json"]
    folder = tmp / "export"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    raw = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    return ours, files, auto, raw


def test_same_ids_and_round_trip(exported, corpus):
    ours, _, auto, raw = exported
    raw.encode_special_tokens = True  # what split_special_tokens in tokenizer_config.json does
    for text in [corpus, *SAMPLES]:
        ids = ours.encode(text)
        assert auto.encode(text, add_special_tokens=False) == ids, text[:80]
        assert raw.encode(text, add_special_tokens=False).ids == ids, text[:80]
        assert auto.decode(ids) == text


def test_unicode_everywhere(exported):
    # The split pattern's classes (\p{L}, \p{N}, \s, case-insensitive 's) as Oniguruma reads them,
    # against tiktoken's engine: every code point of the first planes and a sample beyond, in
    # contexts that make each class matter.
    ours, _, auto, _ = exported
    if ours.kind == "huggingface":
        pytest.skip("a tokenizer.json dataset is the same file on both sides")
    points = [*range(0x20, 0x3400), *range(0x3400, 0x110000, 97)]
    chars = [chr(c) for c in points if not 0xD800 <= c < 0xE000]
    for context in ("a{c}1 {c}'s", "\n{c}{c} "):
        text = "".join(context.format(c=c) for c in chars)
        assert auto.encode(text, add_special_tokens=False) == ours.encode(text), context


def test_vocabulary_soup(exported):
    # The merges, hardest pressed: random tokens of the vocabulary itself (every script it has
    # words of), run together or apart, so that tiktoken merges across and inside them.
    ours, _, auto, raw = exported
    rng = random.Random(0)
    ids = sorted(set(raw.get_vocab().values()) - set(raw.get_added_tokens_decoder()))
    words = [w for w in (ours.decode([i]) for i in rng.choices(ids, k=20_000)) if "\ufffd" not in w]
    text = "".join(w + rng.choice(["", "", " ", "\n", "'s", "7"]) for w in words)
    assert auto.encode(text, add_special_tokens=False) == ours.encode(text)


def test_every_token_decodes_the_same(exported):
    # Each id alone, the special ones and the pieces of a UTF-8 character (replaced) included, shows
    # that every token is spelled and numbered as ours.
    ours, _, _, raw = exported
    vocab = raw.get_vocab(with_added_tokens=True)
    ids = sorted(vocab.values())
    assert [raw.decode([i], skip_special_tokens=False) for i in ids] == [ours.decode([i]) for i in ids]


def test_end_of_text(exported):
    ours, files, auto, raw = exported
    raw.encode_special_tokens = False  # the tokenizers library's default (another test sets it)
    eos = json.loads(files["tokenizer_config.json"])["eos_token"]
    assert auto.eos_token == eos and auto.eos_token_id == ours.eot_id
    assert raw.id_to_token(ours.eot_id) == eos and auto.decode([ours.eot_id]) == eos
    assert auto.decode(ours.encode("a") + [ours.eot_id], skip_special_tokens=True) == "a"
    # a batch pads with end-of-text, config.json's pad_token_id (on the right: a model's own padding side)
    padded = auto(["a", "a b c"], padding=True, add_special_tokens=False)["input_ids"]
    assert padded[0] == ours.encode("a") + [ours.eot_id] * (len(padded[1]) - len(ours.encode("a")))
    # In a document the end-of-text's spelling is text to our encode (ordinary text only), and so
    # to AutoTokenizer, told by split_special_tokens; the tokenizers library by default reads it
    # as the special token, as does AutoTokenizer when asked to.
    text = f"a{eos}b"
    assert ours.eot_id not in ours.encode(text)
    assert auto.encode(text, add_special_tokens=False) == ours.encode(text)
    assert ours.eot_id in raw.encode(text, add_special_tokens=False).ids
    assert ours.eot_id in auto.encode(text, add_special_tokens=False, split_special_tokens=False)


def test_nothing_added_around_the_text(exported):
    ours, _, auto, _ = exported
    if ours.kind == "huggingface":
        # its tokenizer.json goes out as it came, post-processor and all
        assert auto.encode("abc") == [auto.convert_tokens_to_ids("<s>")] + ours.encode("abc")
    else:
        assert auto.encode("abc") == auto("abc")["input_ids"] == ours.encode("abc")


def test_tokenizer_config(exported):
    ours, files, _, _ = exported
    config = json.loads(files["tokenizer_config.json"])
    # prepare.py adds no EOS, and a BOS only where the tokenizer.json's post-processor does (<s> here)
    bos = {"bos_token": "<s>"} if ours.kind == "huggingface" else {}
    assert config == {"tokenizer_class": "PreTrainedTokenizerFast",
                      "eos_token": "</s>" if ours.kind == "huggingface" else "<|endoftext|>", **bos,
                      "pad_token": "</s>" if ours.kind == "huggingface" else "<|endoftext|>",
                      "add_bos_token": bool(bos), "add_eos_token": False,
                      "split_special_tokens": True, "clean_up_tokenization_spaces": False}
    if ours.kind == "huggingface":
        assert files["tokenizer.json"] == ours.hf_json


@pytest.mark.parametrize("single, pair, in_sequence", [("<s> $A </s>", "<s> $A </s> $B </s>", False),
                                                    ("$A </s>", "$A </s> $B </s>", False),
                                                    ("<s> $A </s>", "<s> $A </s> $B </s>", True),
                                                    ("<s> $A", "<s> $A </s> </s> $B </s>", False)])
def test_a_post_processor_adding_an_eos_goes_out_adding_the_bos_alone(tmp_path, corpus, single, pair, in_sequence):
    # prepare.py never writes the EOS a tokenizer.json's post-processor appends to a text (it ends a document with
    # end-of-text itself), and transformers, given add_eos_token false, would still add it to every prompt: the
    # export keeps the BOS alone, so that AutoTokenizer encodes a prompt (or a pair) as the model saw its text; a
    # template within a Sequence (after ByteLevel's offsets) is mended there, and a pair template that alone adds
    # an EOS too
    from tokenizers import Tokenizer, processors
    huggingface_case(tmp_path, corpus)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=[("<s>", 0), ("</s>", 1)])
    if in_sequence:
        hf.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), hf.post_processor])
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = tokenizer.make_tokenizer(str(tmp_path / "tokenizer.json"), lambda: iter(()))
    files, _ = tokenizer_json.hf_tokenizer_files(ours)
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    bos = single.startswith("<s>")
    assert ours.bos_id == (0 if bos else None)
    assert auto.encode("abc def") == [0] * bos + ours.encode("abc def")
    assert auto.encode("abc", "def") == [0] * bos + ours.encode("abc") + ours.encode("def")
    kept = json.loads(files["tokenizer.json"])["post_processor"]
    assert [p["type"] for p in kept.get("processors", [kept])] == ["ByteLevel"] * in_sequence + ["TemplateProcessing"]


def test_char_has_no_tokenizer_json():
    tok = tokenizer.make_tokenizer("char", lambda: iter(["hello world"]))
    files, note = tokenizer_json.hf_tokenizer_files(tok)
    assert files == {} and "character vocabulary" in note and "\n" not in note


def test_pattern_rewrite_for_oniguruma():
    # Oniguruma repeats `{1,3}` under a `+` (digits would not come in threes) and ends a line at
    # `$`; the rewrite makes them tiktoken's possessive repeat and end of text.
    from tokenizers import Regex, pre_tokenizers

    def split(pattern, text):
        splitter = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return [piece for piece, _ in splitter.pre_tokenize_str(text)]

    pattern = r"\p{N}{1,3}+|\s+$|\s+|."
    assert tokenizer_json.onig_pattern(pattern) == r"(?>\p{N}{1,3})|\s+\z|\s+|."
    assert split(pattern, "1234567 a  \nb") == ["1234567", " ", "a", "  ", "\n", "b"]
    assert split(tokenizer_json.onig_pattern(pattern), "1234567 a  \nb") == ["123", "456", "7", " ", "a", "  \n", "b"]
    assert tokenizer_json.onig_pattern(r"[$]|\$|\p{L}++|x{2}") == r"[$]|\$|\p{L}++|x{2}"


def test_byte_chars_are_gpt2s():
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    assert tokenizer_json.byte_chars() == bytes_to_unicode()


def test_a_tokenizer_saved_with_truncation_or_padding_cuts_and_pads_nothing(tmp_path, corpus):
    # a tokenizer.json saved with truncation or padding on (sentence-transformers' are) would cut every document
    # to its max_length, or pad it: prepare.py's encoders and the exported file have neither, as AutoTokenizer
    huggingface_case(tmp_path, corpus)
    plain = tokenizer.make_tokenizer(str(tmp_path / "tokenizer.json"), lambda: iter(()))
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.enable_truncation(max_length=8)
    hf.enable_padding(length=64, pad_id=1, pad_token="</s>")
    hf.save(str(tmp_path / "tokenizer.json"))
    ours = tokenizer.make_tokenizer(str(tmp_path / "tokenizer.json"), lambda: iter(()))
    text = corpus[:2000]
    ids = plain.encode(text)
    assert len(ids) > 64 and ours.encode(text) == ids and ours.encode_chat(text, [])[0].tolist() == ids
    exported = HFTokenizer.from_str(tokenizer_json.hf_tokenizer_files(ours)[0]["tokenizer.json"])
    assert exported.encode(text, add_special_tokens=False).ids == ids


def test_what_the_tokenizer_json_writer_cannot_keep_is_refused_in_a_line():
    # a special token that is one of the vocabulary's, or an id it has; a group repeated possessively, which
    # Oniguruma's rewrite does not handle
    from lib.files import UserError
    ranks = {bytes([b]): b for b in range(256)}
    with pytest.raises(UserError, match="a special token repeats a token or an id of the vocabulary"):
        tokenizer_json.bytelevel_tokenizer_json(ranks, r"\s+|.", {"<|endoftext|>": 0})
    with pytest.raises(UserError, match="repeats a group possessively"):
        tokenizer_json.onig_pattern(r"(?:ab){1,3}+")
