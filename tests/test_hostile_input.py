"""
Hostile and careless input: each case either works correctly or ends in one line naming the problem
and the fix, within bounded memory and time. Small crafted inputs, table-driven; a subprocess only where the
one-line exit itself is what is tested.

    python -m pytest tests/test_hostile_input.py -q
"""

import errno
import gzip
import json
import os
import re
import signal
import struct
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import prepare
from helpers import needs_tiktoken, new_python, script, train_refusal
from lib import checkpoint as ckpt
from lib import resume
from lib import hf
from lib.files import UserError, read_meta
from lib.tokenizer import load_tokenizer
from model import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


class Overdue(BaseException):
    # the deadline's: no OSError (as TimeoutError is), nor any Exception, that the code's own handlers would take
    pass


@contextmanager
def deadline(seconds):
    # What today's code would do forever (a FIFO's open, two nested loops) fails the test instead of hanging it:
    # the alarm's exception interrupts the blocking call or the loop.
    def expired(*_):
        raise Overdue(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextmanager
def released(fifo, seconds=5):
    # A FIFO's open for reading waits for a writer, inside code that no signal interrupts and that may hold the GIL
    # (safetensors' Rust, torch's C++): after seconds another process opens it for writing and closes it, again and
    # again, so that code missing its check reads an empty file and the test fails on what it raises, not hangs.
    writer = subprocess.Popen([sys.executable, "-c", RELEASE, str(fifo), str(seconds)])
    try:
        with deadline(seconds + 15):
            yield
    finally:
        writer.kill()
        writer.wait()


RELEASE = """import os, sys, time
time.sleep(float(sys.argv[2]))
while True:
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader waits
    except OSError:
        pass
    time.sleep(0.05)
"""


def built_on_meta_only(monkeypatch, module):
    # A model of the lying sizes would take memory (or, of 10**9 blocks, time) without bound: it may only be
    # built on the meta device, as many blocks as the weights hold, to compare its shapes with theirs.
    def checked(config):
        assert torch.empty(0).device.type == "meta" and config.n_layer == TINY.n_layer, "built before checked"
        return GPT(config)
    monkeypatch.setattr(module, "GPT", checked)

# -----------------------------------------------------------------------------
# a Hugging Face folder's config.json against its safetensors headers, and its shard index


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    hf.save_pretrained(GPT(TINY), tmp_path / "model")
    return tmp_path / "model"


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("changes, says", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
    ({"hidden_size": 10**7}, "shape"),
    ({"intermediate_size": 10**9}, "shape"),
    ({"vocab_size": 10**9}, "shape"),
    ({"num_hidden_layers": -1}, "num_hidden_layers|n_layer=-1"),
    ({"hidden_size": "32"}, "config.json says hidden_size='32'"),  # (config.json's names, not ours: n_embd)
    ({"num_attention_heads": 0}, "num_attention_heads=0"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps='tiny'"),
    ({"max_position_embeddings": 10**12}, "max_position_embeddings=1000000000000"),
])
def test_config_json_is_checked_against_the_weights_before_anything_is_built(folder, monkeypatch, changes, says):
    edit_config(folder, **changes)
    built_on_meta_only(monkeypatch, hf)
    with pytest.raises(ValueError, match=says):
        hf.load_pretrained(folder)


@pytest.mark.parametrize("text, says", [("[" * 100_000 + "]" * 100_000, "is not valid JSON (maximum recursion"),
                                        ("[1, 2]", "holds a JSON list, not an object")])
def test_a_model_folders_json_that_is_no_object_is_one_line(folder, tmp_path, text, says):
    # config.json read by load_pretrained (sample.py --model, --init_from); tokenizer_config.json by prepare.py's
    # chat template; a dataset's meta.json by train.py: each refused in one line, not a traceback
    (folder / "config.json").write_text(text)
    with pytest.raises(UserError, match=re.escape(f"config.json {says}")):
        hf.load_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(text)
    from lib.chat import find_template
    with pytest.raises(UserError, match=re.escape(f"tokenizer_config.json {says}")):
        find_template(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": ["{{ x }}", {"name": "default"}]}))
    assert find_template(folder)[1] == "built-in"  # a list of named templates with no default one: ours
    tiny_dataset(tmp_path / "d")
    (tmp_path / "d" / "meta.json").write_text(text)
    with pytest.raises(UserError, match="meta.json is damaged"):
        read_meta(tmp_path / "d")


def test_the_checked_folder_still_loads(folder):
    model = hf.load_pretrained(folder)
    assert model.config.n_layer == 2 and model.config.n_embd == 32


def write_index(folder, shard):
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("shard, says", [
    ("/etc/passwd", "not a file inside"),
    ("../other/model.safetensors", "outside"),
    ("link.safetensors", "outside"),
    ("fifo.safetensors", "not a regular file"),
    (7, "not a file inside"),
])
def test_a_shard_index_names_only_regular_files_inside_the_folder(folder, tmp_path, shard, says):
    (tmp_path / "other").mkdir()
    os.link(folder / "model.safetensors", tmp_path / "other" / "model.safetensors")
    os.symlink(tmp_path / "other" / "model.safetensors", folder / "link.safetensors")
    os.mkfifo(folder / "fifo.safetensors")
    write_index(folder, shard)
    with released(folder / "fifo.safetensors"), pytest.raises(ValueError, match=says):  # before any is opened
        hf.safetensors_files(folder)


@pytest.mark.parametrize("dtype, kind", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3")])
def test_integer_tensors_are_refused_where_floats_belong(folder, dtype, kind):
    # and float8's, which no op of ours computes in (a quantized release without its quantization_config)
    from safetensors.torch import load_file, save_file
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"], dtype=dtype)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"{kind} values, not float32, bfloat16 or float16 weights"):
        hf.load_pretrained(folder)


@pytest.mark.parametrize("header", [b"{}", b'{"__metadata__": {"format": "pt"}}'])
def test_a_safetensors_file_without_tensors_is_one_line(folder, header):
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(ValueError, match="holds no tensors"):
        hf.load_pretrained(folder)

# -----------------------------------------------------------------------------
# a checkpoint's model_args against its tensors


def tiny_checkpoint(**args):
    torch.manual_seed(0)
    model = GPT(TINY)
    return {"model": model.state_dict(), "model_args": {**asdict(TINY), **args}, "config": {}}


@pytest.mark.parametrize("args, says", [
    ({"n_layer": 10**9}, "n_layer=1000000000, but its weights hold 2 blocks"),
    ({"n_layer": 1e9}, "n_layer=1000000000.0"),
    ({"n_embd": 10**8}, "shape"),
    ({"vocab_size": 10**9}, "shape"),
    ({"n_embd": -64}, "n_embd=-64"),
    ({"n_head": 0}, "n_head=0"),
    ({"n_embd": "32"}, "n_embd='32'"),
    ({"block_size": 10**12}, "block_size=1000000000000"),
])
def test_model_args_are_checked_against_the_tensors_before_anything_is_built(monkeypatch, args, says):
    built_on_meta_only(monkeypatch, resume)
    with pytest.raises(ValueError, match=says):
        resume.model_from_checkpoint(tiny_checkpoint(**args))


@pytest.mark.parametrize("args, says", [({"n_layer": 10**9}, "n_layer=1000000000, but it holds the weights of 2"),
                                         ({"n_layer": 1e9}, "n_layer=1000000000.0, not a whole number")])
def test_a_sharded_checkpoint_is_checked_before_its_model_is_built_to_resume(args, says):
    # a sharded checkpoint's state.pt names its parameters in its optimizer's param_groups; its tensors are read
    # into the model later, once train.py has built it from model_args
    names = list(GPT(TINY).state_dict())
    state = {"format": ckpt.FORMAT, "model_args": {**asdict(TINY), **args}, "param_groups": [{"params": names}],
             "config": {}}
    with pytest.raises(ValueError, match=says):
        resume.check_resume(state, {"optimizer": "adamw", "block_size": 16}, 64, "out/ckpt")


@pytest.mark.parametrize("written", [{"format": ckpt.FORMAT - 1}, {}])
def test_a_checkpoint_of_another_format_is_refused_to_resume_in_one_line(written):
    # a resume reads today's checkpoints alone: an older one (no format recorded, or another number) is named
    state = {**written, "model_args": asdict(TINY), "config": {}}
    with pytest.raises(ValueError, match=r"^out/ckpt.pt was written by another train.py \(checkpoint format "
                                         r".*resume it with the train.py that wrote it"):
        resume.check_resume(state, {"optimizer": "adamw", "block_size": 16}, 64, "out/ckpt.pt")


def test_a_checkpoint_with_tensors_its_model_lacks_is_one_line():
    checkpoint = tiny_checkpoint()
    checkpoint["model"]["blocks.0.extra"] = torch.zeros(3)
    with pytest.raises(ValueError, match="do not fit its model_args"):
        resume.model_from_checkpoint(checkpoint)
    checkpoint["model"][3] = checkpoint["model"].pop("blocks.0.extra")  # a weight's name that is no name
    with pytest.raises(ValueError, match=r"model is not a dict \(of weights by name\)"):
        resume.model_from_checkpoint(checkpoint)


def test_an_empty_ckpt_pt_is_one_line(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="not a readable checkpoint"):
        resume.load_checkpoint(tmp_path / "ckpt.pt")


def test_bytes_of_any_other_kind_named_ckpt_pt_are_one_line(tmp_path):
    # a text file, and short random ones: torch's legacy reader fails on them with KeyError, IndexError,
    # UnicodeDecodeError, struct.error...; each is refused as not a checkpoint (or as holding other objects)
    rng = np.random.default_rng(0)
    for data in [b"hello\n", *(rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8).tobytes() for _ in range(200))]:
        (tmp_path / "ckpt.pt").write_bytes(data)
        with pytest.raises(ValueError, match="not a readable checkpoint|holds objects other than tensors"):
            resume.load_checkpoint(tmp_path / "ckpt.pt")

# -----------------------------------------------------------------------------
# prepare.py: text with no safe cut, --min_length on big files, nested JSON

def capped(megabytes):
    # for a child: its address space capped, so that a bomb ends it rather than the machine
    import resource
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (megabytes << 20, megabytes << 20))


@needs_tiktoken
@pytest.mark.slow
def test_text_without_a_safe_cut_is_encoded_in_bounded_pieces(tmp_path):
    # 4 MB of one repeated byte, gzipped to 4 KB: held whole, tiktoken takes ~250 MB for it (30 GB for a 1 MiB
    # gzip of 1 GB); cut every HARD_CUT characters, prepare.py runs in 400 MB of address space.
    with gzip.open(tmp_path / "bomb.txt.gz", "wb") as f:
        f.write(b"a" * (4 << 20))
    r = subprocess.run([sys.executable, "prepare.py", tmp_path / "bomb.txt.gz", "--out_dir", tmp_path / "d",
                        "--num_workers=1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                       preexec_fn=capped(400))
    assert r.returncode == 0, r.stderr[-300:]
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    assert meta["hard_cuts"] >= 3 and "no safe place to cut" in r.stdout
    assert 0 <= meta["train"]["tokens"] + meta["val"]["tokens"] - (4 << 20) // 4 < 10  # 'aaaa' is one token


def folder_state(folder):
    # every file of a folder with its bytes (None: no folder), to show that a stopped run left it as it was
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())} if folder.exists() else None


@needs_tiktoken
@pytest.mark.parametrize("earlier", [False, True])
def test_a_compression_bomb_is_refused_in_one_line_and_the_folder_left_as_it_was(tmp_path, earlier):
    # 128 MiB of one letter in 135 KB of gzip (1 MiB members, each 1 KB): GPT-2's tokenizer would take minutes on
    # it (a 1 MiB gzip of 1 GiB ran past 10 minutes). It is the third document, met while the outputs are open.
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("hello world\n" * 10)
    (tmp_path / "in" / "b.txt").write_text("goodbye world\n" * 10)
    (tmp_path / "in" / "c.txt.gz").write_bytes(gzip.compress(b"a" * (1 << 20)) * 128)
    if earlier:  # a dataset there before, to be replaced (--overwrite) only by a finished one
        prepare.main([str(tmp_path / "in" / "a.txt"), "--tokenizer=char", "--out_dir", str(tmp_path / "d")])
    before = folder_state(tmp_path / "d")
    done = subprocess.run([sys.executable, "prepare.py", tmp_path / "in", "--out_dir", tmp_path / "d",
                           "--overwrite", "--num_workers=1"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, preexec_fn=capped(400))
    one_line(done, "prepare.py", "c.txt.gz inflates to over 100 times its size", "gunzip it")
    assert done.returncode == 1 and folder_state(tmp_path / "d") == before


def test_min_length_applies_to_documents_of_several_pieces(tmp_path):
    # three files of over 64 KB, read in pieces: the middle one has fewer characters (tokens) than min_length
    lines = lambda n, word: "".join(f"{word} {i}\n" for i in range(n))
    texts = {"a.txt": lines(30000, "first"), "b.txt": lines(9000, "short"), "c.txt": lines(30000, "last")}
    for name, text in texts.items():
        (tmp_path / "in").mkdir(exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    assert 64 << 10 < len(texts["b.txt"]) < 100_000 < len(texts["a.txt"])
    meta = prepare.main([str(tmp_path / "in"), "--tokenizer=char", "--out_dir", str(tmp_path / "d"),
                         "--min_length=100000", "--val_fraction=0"])
    assert meta["short_dropped"] == 1 and meta["train"]["documents"] == 2
    ids = np.fromfile(tmp_path / "d" / "train.bin", dtype=meta["dtype"])
    tokenizer = load_tokenizer(tmp_path / "d")
    eot = tokenizer.decode([meta["eot_id"]])
    assert tokenizer.decode(ids.tolist()) == texts["a.txt"] + eot + texts["c.txt"] + eot


def test_json_nested_past_the_parsers_depth_is_skipped_and_listed(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text(json.dumps({"text": "kept"}) + "\n" + deep + "\n")
    (tmp_path / "in" / "b.json").write_text(deep)
    meta = prepare.main([str(tmp_path / "in"), "--tokenizer=char", "--out_dir", str(tmp_path / "d")])
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'in' / 'a.jsonl'}:2: JSON nested too deeply"]
    assert meta["skipped_files"] == [{"path": str(tmp_path / "in" / "b.json"), "reason": "JSON nested too deeply"}]

# -----------------------------------------------------------------------------
# chat templates: a step and output budget, and their own errors as one line

PROBE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"


@pytest.mark.parametrize("template, says", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "more than 1,000,000 steps"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}", "steps"),
    ("{{ 'a' * 1000000000 }}", "its \\* makes a value past the budget"),
    ("{{ 2 ** 100000000 }}", "its \\*\\* makes a value past the budget"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
     "more than 16,777,216 characters"),
    ("{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}", "writes more than"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{{ (1e308 * 10) | int }}", "OverflowError"),
    # a % formats its width at once (and a constant one was computed as the template compiled); ints squared grow
    # in time; lipsum writes any length; filters make what their numbers and texts say, before anything measures it
    ("{% set x = '%3000000000s' % 'a' %}", "its % makes a value past the budget"),
    ("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "its \\* makes a value past the budget"),
    ("{{ lipsum(1000000) }}", "'lipsum' is undefined"),
    ("{{ 'a' | center(300000000) }}", "its center filter makes a value past the budget"),
    ("{{ ('a' * 1000000) | replace('a', 'a' * 20) }}", "its replace filter makes a value past the budget"),
    ("{{ range(100000) | join('a' * 10000) }}", "its join filter makes a value past the budget"),
    ("{{ '%3000000000s' | format('a') }}", "its format filter makes a value past the budget"),
    ("{{ {'a': [1, [2]]} | tojson(indent=100000) }}", "its tojson filter makes a value past the budget"),
    # a str's methods make what their numbers say as well: widths, a format's fields (nested ones from values)
    ("{{ 'a'.ljust(10 ** 12) }}", "its ljust makes a text past the budget"),
    ("{{ '{:>300000000}'.format(1) }}", "its format makes a text past the budget"),
    ("{{ '{:>{w}}'.format(1, w=300000000) }}", "its format makes a text past the budget"),
    ("{{ ('a' * 1000000).replace('a', 'a' * 20) }}", "its replace makes a text past the budget"),
    ("{{ ('a' * 10000).join('b' * 10000) }}", "its join makes a text past the budget"),
    ("{{ ('\t' * 100000).expandtabs(4000) }}", "its expandtabs makes a text past the budget"),
    # and what a value repeated by a format's fields or a translation makes, refused before it is made (it was made
    # first: about 1.5 GB at these factors of 100)
    ("{{ ('%(a)s' * 1000) % {'a': 'x' * 100000} }}", "its % makes a value past the budget"),
    ("{{ ('%(a)s' * 1000) | format(a='x' * 100000) }}", "its format filter makes a value past the budget"),
    ("{{ ('{0}' * 1000).format('x' * 100000) }}", "its format makes a text past the budget"),
    ("{{ ('a' * 10000).translate({97: 'b' * 10000}) }}", "its translate makes a text past the budget"),
    # measured in bounded time (each argument walked in full took minutes), and a text in a list as its repr
    ("{% set x = [[]] * 8000000 %}{{ '{}'.format(x, x, x, x, x, x, x, x) }}", "its format makes a text past"),
    ("{{ '{}'.format(['\U000e0001' * 2000000]) }}", "its format makes a text past the budget"),
    # what {{ }} and ~ write, and join's items, measured before str() writes them (0.9 GB, or hours, before); and
    # batch's and slice's numbers held as widths (a list of 200M fillers)
    ("{{ [[[0] * 1000] * 1000] * 300 }}", "it writes a value of more than 16,777,216 characters"),
    ("{{ 'a' ~ [[[0] * 1000] * 1000] * 300 }}", "it writes a value of more than 16,777,216 characters"),
    ("{{ ([[0] * 1000000] * 1000000) | join(',') }}", "its join filter makes a value past the budget"),
    ("{{ [1] | batch(200000000, 0) | list | length }}", "its batch filter makes a value past the budget"),
])
def test_a_chat_template_runs_under_a_budget_and_fails_in_one_line(template, says):
    from lib import chat
    with deadline(20), pytest.raises(ValueError, match=says):  # (past the deadline: another error, a failure)
        chat.ChatFormat(PROBE + template, "test", ["</s>"], "</s>")


def test_a_list_a_chat_template_doubles_is_held_to_the_budget(monkeypatch):
    # + on lists and tuples is measured as on texts: a list doubled 40 times was 2**40 items, a machine's memory
    from lib import chat
    monkeypatch.setattr(chat, "MAX_OUTPUT", 1000)  # (the budget's 16M items, reached in a few steps)
    grow = "{% set ns = namespace(l=[1]) %}{% for i in range(40) %}{% set ns.l = ns.l + ns.l %}{% endfor %}"
    for template in (grow, grow.replace("[1]", "(1,)")):
        with deadline(20), pytest.raises(ValueError, match="it makes a value of more than 1,000 characters or items"):
            chat.ChatFormat(PROBE + template, "test", ["</s>"], "</s>")


def test_a_conversations_renderings_share_one_budget(monkeypatch):
    # each assistant turn renders the conversation before it: time quadratic in the turns, each rendering with a
    # budget of its own (2,000 turns: 44 s; 1 MB of a record: ~45 minutes). One record's renderings share one
    from lib import chat
    fmt = chat.ChatFormat(PROBE, "test", ["</s>"], "</s>")
    def conversation(turns):
        return {"messages": [m for i in range(turns) for m in ({"role": "user", "content": "q"},
                                                               {"role": "assistant", "content": f"a{i}"})]}
    whole = fmt.record(conversation(100))
    monkeypatch.setattr(chat, "MAX_STEPS", 5000)  # (one rendering of 100 turns takes ~500 steps, each turn's ~250)
    assert fmt.record(conversation(10)) == chat.ChatFormat(PROBE, "test", ["</s>"], "</s>").record(conversation(10))
    assert len(whole.spans) == 100 and len(fmt.render(conversation(100)["messages"])) == len(whole.text)
    with pytest.raises(UserError, match=r"refused it \(it takes more than 5,000 steps, rendering its turns one by one\)"
                                        r": split the conversation$"):
        fmt.record(conversation(100))


def test_a_meta_pkl_past_any_nanogpts_is_refused_unread(tmp_path):
    from lib.files import MAX_PICKLE, read_plain_pickle
    with open(tmp_path / "meta.pkl", "wb") as f:  # sparse: no disk, and nothing a reader would parse first
        f.truncate(MAX_PICKLE + 1)
    with pytest.raises(UserError, match=rf"meta.pkl is past {MAX_PICKLE >> 20} MB, which no nanoGPT meta.pkl is"):
        read_plain_pickle(tmp_path / "meta.pkl")


def test_a_meta_pkl_whose_keys_share_a_hash_is_refused_at_once(tmp_path):
    # ints' hashes are not random: keys i * (2**61 - 1) all hash alike, and a dict of 150,000 of them took minutes to
    # unpickle; a meta.pkl's numbers are ids and sizes, and one past 2**31 is refused before anything is built
    import pickle
    from lib.files import read_plain_pickle
    colliding = {"vocab_size": 3, "itos": {i * (2**61 - 1): "a" for i in range(3)}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(colliding))
    with pytest.raises(UserError, match=r"meta.pkl holds the number 2305843009213693951, not an id or a size"):
        read_plain_pickle(tmp_path / "meta.pkl")
    plain = {"vocab_size": 3, "itos": {0: "a", 1: "b", 2: "c"}, "stoi": {"a": 0, "b": 1, "c": 2}}
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(plain))
    assert read_plain_pickle(tmp_path / "meta.pkl") == plain


def test_a_tokenizer_json_with_an_id_past_any_vocabulary_is_refused_by_prepare(tmp_path):
    # prepare.py wrote its dataset, which train.py refused, asking for it to be prepared again: refused where it is read
    from tokenizers import Tokenizer, models, pre_tokenizers
    from lib.tokenizer import make_tokenizer
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1, "<|endoftext|>": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["model"]["vocab"]["<|endoftext|>"] = 2_000_000_000  # (written as text: the library's own save takes 10 s)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=r"has the id 2,000,000,000, past 16,777,216, more than any tokenizer has"):
        make_tokenizer(str(tmp_path / "tokenizer.json"), None)


def test_a_chat_template_runs_under_a_time_budget(monkeypatch):
    # an `in` over a long text is one step of a loop but takes a while: a rendering stops at MAX_SECONDS
    from lib import chat
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.5)
    slow = "{% set big = 'a' * 16000000 %}{% for i in range(100000) %}{% if 'ab' in big %}{% endif %}{% endfor %}"
    with deadline(20), pytest.raises(ValueError, match=r"it takes more than 0.5 s\)$"):
        chat.ChatFormat(PROBE + slow, "test", ["</s>"], "</s>")


def test_what_templates_write_within_the_budget_renders_as_jinja_renders_it():
    # a number in the text a % formats is no width; %% is a percent sign; filters with their usual numbers
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from lib.chat import compile_template
    template = ("{{ 'Step 5000: %s, %%5000, %05.2f' % ('x', 3.14159) }} {{ '%s-%d' | format('a', 7) }} "
                "{{ 'a b' | replace(' ', '_') }} {{ ['x', 'y'] | join(', ') }} {{ 'ab' | center(6) }} "
                "{% for i in range(3) %}{{ i % 2 }}{{ 2 ** 10 * i }}{% endfor %} {{ 'x\ny' | indent(4) }}"
                # numbers past any width where no filter writes that much: tool calls' arguments, timestamps
                "{{ {'amount': 5000, 'ts': 1700000000} | tojson }} {{ 60000 | string }} {{ 'abc' | truncate(5000) }}"
                "{{ '%d tokens' | format(5000) }} {{ 42 | format }}"
                # and a str's methods with theirs
                "{{ 'ab'.ljust(6) }} {{ '{:>5} {} tokens'.format(3, 60000) }} {{ '{x}'.format_map({'x': 70000}) }}"
                "{{ 'a-b'.replace('-', '+') }} {{ ', '.join(['x', 'y']) }} {{ 'ab'.startswith('a', 5000) }}")
    assert compile_template(template)() == ImmutableSandboxedEnvironment().from_string(template).render()

# -----------------------------------------------------------------------------
# a dataset's meta.json names its tokenizer's file inside its folder; a pattern the regex engine refuses


def char_dataset(folder):
    (folder / "in.txt").write_text("hello world\n" * 10)
    prepare.main([str(folder / "in.txt"), "--tokenizer=char", "--out_dir", str(folder / "d")])
    return folder / "d"


def name_tokenizer_file(dataset, name):
    meta = json.loads((dataset / "meta.json").read_text())
    meta["tokenizer"]["file"] = name
    (dataset / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("name, says", [
    ("/dev/zero", "not a file inside"),
    ("../in.txt", "outside"),
    ("fifo.json", "not a regular file"),
    (None, "not a file inside"),
])
def test_the_tokenizer_file_is_a_regular_file_in_the_datasets_folder(tmp_path, name, says):
    dataset = char_dataset(tmp_path)
    os.mkfifo(dataset / "fifo.json")
    name_tokenizer_file(dataset, name)
    with released(dataset / "fifo.json"), pytest.raises(ValueError, match=says):
        load_tokenizer(dataset)


def test_a_tokenizer_pattern_the_regex_engine_refuses_is_one_line(tmp_path):
    dataset = tmp_path / "bpe"
    (tmp_path / "in.txt").write_text("hello world\n" * 10)
    prepare.main([str(tmp_path / "in.txt"), "--tokenizer=bpe:260", "--out_dir", str(dataset)])
    tokenizer_file = dataset / json.loads((dataset / "meta.json").read_text())["tokenizer"]["file"]
    data = json.loads(tokenizer_file.read_text())
    tokenizer_file.write_text(json.dumps({**data, "pattern": "(unclosed"}))
    with pytest.raises(ValueError, match="cannot read the tokenizer in .*re-run prepare.py"):
        load_tokenizer(dataset)

def rules_tokenizer(path, normalizer=None, split=None, decoder=None, unk="[UNK]"):
    # a tokenizer.json of two words, with the normalizer, split regex or decoder of a hostile one (or its unknown
    # word's token not in its vocabulary)
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    hf = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1}, unk_token=unk))
    hf.normalizer, hf.decoder = normalizer, decoder
    if split:
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    hf.save(str(path))
    return path


@pytest.mark.parametrize("rules, says", [
    # a space made 20,000 characters: the 48 KB of text asked for 2 GB and the library aborted the process
    ({"normalizer": "replace"}, "may make one character into 20,000 (its Replace rule)"),
    # three Replaces of e by 1,000 e's in a decoder: 10^9 characters of a token's e (the report's example decoded)
    ({"decoder": "replace"}, "decoder may make one character into 1,000,000,000 (its Replace rule)"),
    # nested repeats: the ran 120 s on 48 KB without progress; this one takes ~1 s a 200 runs of 20
    ({"split": r"(a+)+b"}, "repeats a group of repeats or alternatives"),
    ({"split": r"(a|aa)+b"}, "repeats a group of repeats or alternatives"),
    # no group repeated, but past the regex engine's retry limit on a run of 60: a panic, a traceback before
    ({"split": r"\w*" * 10 + "c"}, "failed on a document (PanicException: Onig: Regex search error"),
    # no group repeated, under the retry limit, but cubic in a run of letters: 12 minutes on 20,000 a's, SIGTERM unheard
    ({"split": r"[a-z]*[a-z]*\d"}, "times its time on 250: its rules (a regex that backtracks, a WordPiece's"),
    # no run of one character is slow, but a run of "z a" is quartic: ~25 s on this test's 1,600 characters, hours
    # on a book's; the deadline of a call (5 s, and 100 us a character) stops it
    pytest.param({"split": r"z[^y]*z[^y]*z[^y]*w"}, "took more than 5 s on 1,601 characters: its rules (a regex that "
                 "backtracks)", marks=pytest.mark.slow),
    # the library's own error, a plain Exception, went out as a traceback
    ({"unk": "[MISSING]"}, "failed on a text (WordLevel error: Missing [UNK] token from the vocabulary)"),
])
def test_a_tokenizer_whose_rules_blow_up_is_stopped_in_one_line_and_the_folder_left_as_it_was(tmp_path, rules, says):
    from tokenizers import normalizers
    from tokenizers import decoders
    if rules.get("normalizer"):
        rules = {"normalizer": normalizers.Replace(" ", "x" * 20000)}
    if rules.get("decoder"):
        rules = {"decoder": decoders.Sequence([decoders.Replace("e", "e" * 1000)] * 3)}
    tokenizer = rules_tokenizer(tmp_path / "tokenizer.json", **rules)
    text = "z a " * 400 + "\n" if "z" in rules.get("split", "") else ("a" * 20 + "c " + "a" * 60 + "-c\n") * 5
    (tmp_path / "in.txt").write_text(text)  # small: old code ran it whole
    prepare.main([str(tmp_path / "in.txt"), "--tokenizer=char", "--out_dir", str(tmp_path / "d")])
    before = folder_state(tmp_path / "d")
    done = subprocess.run([sys.executable, "prepare.py", tmp_path / "in.txt", "--out_dir", tmp_path / "d",
                           "--overwrite", f"--tokenizer={tokenizer}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, preexec_fn=capped(4000))
    if "Panic" in says:  # Rust's panic hook has printed the library's own message first: no Python code stops it
        assert "Traceback" not in done.stdout + done.stderr
        done.stderr = done.stderr.strip().splitlines()[-1]
    one_line(done, "prepare.py", str(tokenizer), says, "use the model's own tokenizer.json")
    assert done.returncode == 1 and folder_state(tmp_path / "d") == before


def test_a_tokenizer_that_cannot_spell_a_character_of_the_time_probe_still_loads():
    # a WordLevel of its corpus's words and no [UNK]: a run of a's (no word of it) raises in the library, which the
    # load's probe of time took for a refusal: datasets prepared with it could no longer be read
    from tokenizers import Tokenizer, models, pre_tokenizers
    from lib.tokenizer import hf_tokenizer
    hf = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2}))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = hf_tokenizer("words", hf.to_str())
    assert tokenizer.encode("a b a") == [1, 2, 1]


@needs_tiktoken
def test_released_tokenizers_rules_pass_the_checks():
    # the split patterns of tiktoken's encodings and of Llama 3, and the normalizers of Llama 2 and ALBERT
    import tiktoken

    from lib.bounds import MAX_GROWTH, nested_repeat, tokenizer_growth
    from lib.tokenizer_json import onig_pattern
    llama3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
    for pattern in [tiktoken.get_encoding(name)._pat_str for name in ("gpt2", "cl100k_base", "o200k_base")]:
        assert not nested_repeat(pattern) and not nested_repeat(onig_pattern(pattern)), pattern
    assert not nested_repeat(llama3)
    def replace(pattern, content, kind="String"):
        return {"type": "Replace", "pattern": {kind: pattern}, "content": content}
    llama2 = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, replace(" ", "▁")]}
    albert = {"type": "Sequence", "normalizers": [replace("``", '"'), {"type": "NFKD"}, {"type": "StripAccents"},
                                                  {"type": "Lowercase"}, replace(" {2,}", " ", "Regex")]}
    assert tokenizer_growth([llama2, {"type": "Metaspace"}]) == (4, "Prepend")
    assert tokenizer_growth([albert, {"type": "Metaspace"}])[0] == 72 <= MAX_GROWTH
    llama2_decoder = {"type": "Sequence", "decoders": [replace("▁", " "), {"type": "ByteFallback"}, {"type": "Fuse"},
                                                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    assert tokenizer_growth([llama2_decoder])[0] == 1 and tokenizer_growth([{"type": "ByteLevel"}])[0] <= MAX_GROWTH

# -----------------------------------------------------------------------------
# silently wrong datasets, and one line, always: through the scripts, where the one-line exit is the point

TRAIN = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16", "--batch_size=2", "--max_iters=1",
         "--eval_iters=1", "--device=cpu", "--compile=False"]


def tiny_dataset(folder, dtype="uint16", vocab_size=62, top=None):
    folder.mkdir()
    ids = np.random.default_rng(0).integers(0, vocab_size, 3000).astype(np.uint16)
    ids[100] = top if top is not None else ids[100]
    ids[:2500].tofile(folder / "train.bin")
    ids[2500:].tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": dtype, "vocab_size": vocab_size, "eot_id": 0}))
    return folder


def one_line(done, script, *words):
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and lines[0].startswith(f"{script}: "), done.stderr[-2000:]
    for word in words:
        assert word in lines[0], lines[0]


@pytest.mark.parametrize("meta, says", [
    ({"dtype": "uint8"}, "dtype uint8 is not uint16 or uint32"),
    ({"dtype": "int16"}, "dtype int16 is not uint16 or uint32"),
    ({"dtype": "uint16", "vocab_size": 100_000}, "cannot hold"),
    ({"eot_id": -1}, "eot_id -1 is not a token id"),
    ({"eot_id": 62}, "eot_id 62 is not a token id"),
])
def test_meta_json_that_would_read_the_tokens_wrong_is_refused(tmp_path, meta, says):
    dataset = tiny_dataset(tmp_path / "d")
    (dataset / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 62, "eot_id": 0, **meta}))
    with pytest.raises(ValueError, match=says):
        read_meta(dataset)


@pytest.mark.parametrize("vocab_size", ["abc", 1e400, -5, [64]])
def test_a_model_folders_vocab_size_that_is_no_count_is_one_line(folder, tmp_path, vocab_size):
    # train.py --init_from=FOLDER compares the folder's vocabulary with the data's first
    edit_config(folder, vocab_size=vocab_size)
    said = train_refusal(*TRAIN, f"--data_dir={tiny_dataset(tmp_path / 'd')}", f"--init_from={folder}",
                         f"--out_dir={tmp_path / 'out'}")
    assert f"config.json's vocab_size is {json.loads(json.dumps(vocab_size))!r}, not a whole number above 0" in said


@pytest.mark.parametrize("case, args, says", [
    ("id past meta.json's vocab_size", [], "holds token id 63 at position 100, past meta.json's vocab_size 62"),
    ("train.bin a folder", [], "is not a regular file (a FIFO, a device or a folder)"),
    ("negative width", ["--n_embd=-64"], "n_embd=-64, not a whole number above 0"),
    ("unknown device", ["--device=tpu"], "device='tpu' is not one of"),
])
def test_train_py_refuses_in_one_line(tmp_path, case, args, says):
    dataset = tiny_dataset(tmp_path / "d", top=63 if "vocab_size" in case else None)
    if "folder" in case:
        os.remove(dataset / "train.bin")
        (dataset / "train.bin").mkdir()
        (dataset / "train.bin" / "x").write_bytes(b"\0" * 5000)
    # train.py's checks in process (helpers.train_refusal); one case end to end, the script naming itself
    assert says in train_refusal(*TRAIN, f"--data_dir={dataset}", f"--out_dir={tmp_path / 'out'}", *args)
    if "vocab_size" in case:
        done = new_python("train.py", *TRAIN, f"--data_dir={dataset}", f"--out_dir={tmp_path / 'out'}", *args)
        one_line(done, "train.py", says)


@pytest.mark.parametrize("case, says", [
    ("0-byte ckpt.pt", "not a readable checkpoint (EOFError"),
    ("tokenizer.json that does not load", "cannot load"),
])
def test_sample_py_says_its_own_name_in_one_line(tmp_path, folder, case, says):
    if case.startswith("0-byte"):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "ckpt.pt").write_bytes(b"")
        args = [f"--out_dir={tmp_path / 'out'}"]
    else:
        (folder / "tokenizer.json").write_text('{"model": "broken"}')
        args = [f"--model={folder}"]
    done = new_python("sample.py", *args, "--device=cpu", "--max_new_tokens=2")
    one_line(done, "sample.py", says)


@pytest.mark.parametrize("name, args, says", [
    ("sample.py", ["--foo=1"], "unrecognized arguments: --foo=1 (see python sample.py --help)"),
    ("sample.py", ["--temperature=abc"], "argument --temperature: invalid float value: 'abc'"),
    ("eval.py", ["--foo=1"], "unrecognized arguments: --foo=1 (see python eval.py --help)"),
    ("export.py", [], "the following arguments are required: --to (see python export.py --help)"),
    ("plot.py", [], "the following arguments are required: out_dirs (see python plot.py --help)"),
    ("bench.py", ["--mode=nope"], "argument --mode: invalid choice: 'nope'"),
    ("prepare.py", ["--tokenizer=char", "--num_workers=-1"], "--num_workers and --min_length are counts, at least 0"),
])
def test_a_scripts_command_line_mistake_is_one_line(name, args, says):
    # argparse printed its usage block and exited 2 (prepare.py's alone was one line); --num_workers=-1 ran one thread
    done = script(name, *args)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_export_py_says_its_own_name_in_one_line(tmp_path):
    # the tests call export.py's main in their own process (helpers.in_process); here it runs as a user runs it
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"")
    done = new_python("export.py", f"--out_dir={tmp_path / 'out'}", f"--to={tmp_path / 'hf'}")
    one_line(done, "export.py", "not a readable checkpoint (EOFError")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("at", ["a write", "an open"])
def test_prepare_py_on_a_full_disk_is_one_line_and_leaves_no_dataset(tmp_path, monkeypatch, at):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here to fill a disk with")
    (tmp_path / "in.txt").write_text("hello world\n" * 20000)
    (tmp_path / "d").mkdir()
    opened = prepare.open_own

    def full_disk(path, mode="w", encoding=None):  # every write to train.bin.tmp fails with ENOSPC, or val.bin.tmp's
        if at == "an open" and str(path).endswith("val.bin.tmp"):  # open (train.bin.tmp's was made): no lock left
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return open("/dev/full", mode) if str(path).endswith("train.bin.tmp") and at == "a write" \
            else opened(path, mode, encoding)
    monkeypatch.setattr(prepare, "open_own", full_disk)
    with pytest.raises(UserError, match="^the disk of .* is full .*no dataset was written"):
        prepare.main([str(tmp_path / "in.txt"), "--tokenizer=char", "--out_dir", str(tmp_path / "d")])
    assert sorted(os.listdir(tmp_path / "d")) == []


# -----------------------------------------------------------------------------
# a downloaded folder's planted links and special files: nothing written through them, nothing carried out


@pytest.fixture
def victim(tmp_path):
    # a user's own file outside every folder the project writes, which a planted link names
    path = tmp_path / "victim.txt"
    path.write_text("the user's own words\n")
    return path


def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path, victim):
    from lib.files import lock_folder
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(victim)
    with pytest.raises(UserError, match="is a symbolic link, which this project never writes through"):
        lock_folder(tmp_path / "run", "train.py")
    assert victim.read_text() == "the user's own words\n"


def test_prepare_replaces_a_planted_tmp_link_and_never_writes_through_it(tmp_path, victim):
    (tmp_path / "in.txt").write_text("hello world\n" * 200)
    out = tmp_path / "d"
    prepare.main([str(tmp_path / "in.txt"), "--tokenizer=char", "--out_dir", str(out)])
    for name in ("val.bin.tmp", "train.bin.tmp", "meta.json.tmp", "vocab.json.tmp"):
        (out / name).symlink_to(victim)
    prepare.main([str(tmp_path / "in.txt"), "--tokenizer=char", "--out_dir", str(out), "--overwrite"])
    assert victim.read_text() == "the user's own words\n"
    assert read_meta(str(out))["vocab_size"] > 0 and not any(p.is_symlink() for p in out.iterdir())


def test_metrics_never_appended_through_a_planted_link(tmp_path, victim, capsys):
    from lib.metrics import open_log
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    log, close = open_log(str(tmp_path), {}, master=True)
    log({"iter": 1, "loss": 2.0})
    log({"iter": 2, "loss": 1.0})
    close()
    assert victim.read_text() == "the user's own words\n"
    assert capsys.readouterr().out.count("a symbolic link, never written through") == 1  # warned once, run on


@pytest.mark.parametrize("plant", ["link outside", "fifo", "not json"])
def test_an_export_carries_only_regular_json_files_of_the_base(tmp_path, victim, plant):
    import export
    base, folder = tmp_path / "base", tmp_path / "export"
    base.mkdir()
    folder.mkdir()
    (base / "tokenizer_config.json").write_text('{"model_max_length": 8}')
    export.carry(base, "tokenizer_config.json", folder)  # a regular JSON file of its own goes along, as it is
    assert (folder / "tokenizer_config.json").read_text() == '{"model_max_length": 8}'
    if plant == "link outside":
        (base / "generation_config.json").symlink_to(victim)
    elif plant == "fifo":
        os.mkfifo(base / "generation_config.json")
    else:
        (base / "generation_config.json").write_text("-----BEGIN PRIVATE KEY-----")
    with released(base / "generation_config.json"), \
            pytest.raises(UserError, match="outside|not a regular file|not the JSON object"):
        export.carry(base, "generation_config.json", folder)
    assert not (folder / "generation_config.json").exists()


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_a_fifo_in_a_model_folder_is_one_line_not_a_hang(folder, name):
    os.remove(folder / name)
    os.mkfifo(folder / name)  # opening it for reading would wait for a writer forever
    with released(folder / name), pytest.raises(UserError, match="is not a regular file"):
        hf.load_pretrained(folder)


def test_a_fifo_as_a_checkpoint_is_one_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "ckpt.pt")
    with released(tmp_path / "ckpt.pt"), pytest.raises(UserError, match="is not a regular file"):
        resume.load_checkpoint(str(tmp_path / "ckpt.pt"))



# -----------------------------------------------------------------------------
# weights and settings that would only show as NaN later


def test_a_nan_weight_is_named_when_a_model_is_loaded(folder):
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="model.layers.1.mlp.up_proj.weight .* holds a NaN or an infinite value"):
        hf.load_pretrained(folder)
    checkpoint = tiny_checkpoint()
    checkpoint["model"]["blocks.0.attn.q.weight"][0, 0] = float("inf")
    with pytest.raises(UserError, match="the checkpoint's blocks.0.attn.q.weight holds a NaN or an infinite value"):
        resume.model_from_checkpoint(checkpoint)


@pytest.mark.parametrize("factor", [0, "8", float("nan")])
def test_rope_scaling_that_would_divide_by_zero_or_by_a_string_is_one_line(folder, factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
    edit_config(folder, rope_scaling=scaling)
    with pytest.raises(UserError, match="rope_scaling .* must hold numbers above 0"):
        hf.load_pretrained(folder)
    checkpoint = tiny_checkpoint()  # a checkpoint's model_args, checked by the same rule (a KeyError before)
    checkpoint["model_args"]["rope_scaling"] = {"factor": factor}
    with pytest.raises(UserError, match="the checkpoint's model_args says rope_scaling .* must hold numbers above 0"):
        resume.model_from_checkpoint(checkpoint)


@pytest.mark.parametrize("where", ["rope_theta", "factor"])
def test_rotary_frequencies_past_float32s_range_are_one_line(folder, where):
    # a rope_theta or llama3 factor of 1e-300 is above 0, and 0 in float32: every loss NaN, blamed on the
    # learning rate (eval.py and sample.py ran on, a NaN perplexity and garbage text); 1e-36 was NaN past 3,400
    # positions. A theta above 1 and a factor of at least 1 keep every frequency at most 1
    scaling = {"rope_type": "llama3", "factor": 1e-300 if where == "factor" else 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    edit_config(folder, rope_scaling=scaling, rope_theta=1e-300 if where == "rope_theta" else 1e4)
    with pytest.raises(UserError, match="says rope_theta=1e-300, not a number in its range" if where == "rope_theta"
                       else "rope_scaling .* factor at least 1"):
        hf.load_pretrained(folder)
    edit_config(folder, rope_scaling={**scaling, "factor": 0.5}, rope_theta=1e4)  # above 0, below 1: refused too
    with pytest.raises(UserError, match="rope_scaling .* factor at least 1"):
        hf.load_pretrained(folder)
    checkpoint = tiny_checkpoint()
    checkpoint["model_args"]["rope_theta"] = 1e-36
    with pytest.raises(UserError, match=r"model_args says rope_theta=1e-36, not a number in its range"):
        resume.model_from_checkpoint(checkpoint)


def test_a_lora_rank_past_every_projections_width_is_one_line_before_any_adapter(folder):
    from lib.lora import add_lora
    model = hf.load_pretrained(folder)
    widest = max(max(linear.weight.shape) for _, _, linear in model.projections())  # (the MLP's)
    with pytest.raises(UserError, match=rf"lora_rank=1000000000 is past the widest of the projections it adapts "
                                        rf"\({widest}\)"):
        add_lora(model, 10**9)
    assert not any(hasattr(linear, "lora") for _, _, linear in model.projections())
    assert add_lora(model, widest).blocks[0].attn.k.lora.A.shape[0] == widest  # past k's 32 (peft's too)


def test_a_json_file_past_any_models_is_refused_before_it_is_read(folder, tmp_path, monkeypatch):
    # a 110 MB config.json was read and parsed whole (1.45 GB), and a meta.json too
    from lib import files
    monkeypatch.setattr(files, "MAX_JSON", 1000)
    edit_config(folder, padding=[0] * 1000)
    with pytest.raises(UserError, match=r"config.json is 0 MB, past the 0 MB any such file needs: replace it"):
        hf.load_pretrained(folder)
    tiny_dataset(tmp_path / "d")
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    (tmp_path / "d" / "meta.json").write_text(json.dumps({**meta, "padding": "x" * 1000}))
    with pytest.raises(UserError, match=r"meta.json is 0 MB, past .*: prepare the folder again"):
        read_meta(tmp_path / "d")


def test_a_missing_tensor_is_named_before_the_memory_for_the_model_is_taken(folder, monkeypatch):
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / "model.safetensors")
    del weights["model.embed_tokens.weight"]  # the biggest tensor, which a vocab_size of 2^28 would make 32 GiB
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("memory taken first"))
    with pytest.raises(UserError, match="lacks 1 tensor.* model.embed_tokens.weight"):
        hf.load_pretrained(folder)


@pytest.mark.parametrize("meta, says", [
    ({"dtype": "uint32", "vocab_size": 1 << 40, "eot_id": 0}, "past 16,777,216, more than any tokenizer has"),
])
def test_a_vocab_no_tokenizer_has_is_refused_before_an_embedding_is_sized(tmp_path, meta, says):
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=says):
        read_meta(str(tmp_path))


def test_a_token_file_that_is_a_device_is_named_as_one(tmp_path):
    from lib.files import check_token_files
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 64, "eot_id": 0}))
    os.symlink("/dev/zero", tmp_path / "train.bin")
    (tmp_path / "val.bin").write_bytes(b"\0\0" * 100)
    with pytest.raises(UserError, match="train.bin is not a regular file"):
        check_token_files(str(tmp_path), read_meta(str(tmp_path)), 8)


def test_rotary_tables_past_every_released_model_are_refused_before_they_are_made(folder):
    edit_config(folder, head_dim=4096, max_position_embeddings=1 << 21)  # 3 x 16 GiB of tables, from 500 KB
    with pytest.raises(UserError, match="rotary tables of 32 GiB, past every released model's"):
        hf.load_pretrained(folder)


def test_a_json_record_past_the_limit_is_skipped_without_being_held(tmp_path, monkeypatch):
    import tracemalloc

    from lib import sources
    monkeypatch.setattr(sources, "MAX_RECORD", 1 << 20)  # 1 MB here; 32 MB in a run
    records = [json.dumps({"text": "kept"}), json.dumps({"text": "a" * (40 << 20)}), json.dumps({"text": "too"})]

    def prepared(name, lines):  # (meta, the most memory Python held meanwhile)
        (tmp_path / name).mkdir()
        with gzip.open(tmp_path / name / "a.jsonl.gz", "wt") as f:  # 40 MB of one record: 40 KB on disk
            f.write("".join(line + "\n" for line in lines))
        tracemalloc.start()
        meta = prepare.main([str(tmp_path / name), "--tokenizer=char", "--out_dir", str(tmp_path / f"{name}.d")])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return meta, peak

    small, small_peak = prepared("small", records[::2])
    meta, peak = prepared("big", records)
    assert meta["bad_records"]["examples"] == [f"{tmp_path / 'big' / 'a.jsonl.gz'}:2: a record over 1 MB (split it)"]
    assert meta["train"]["documents"] + meta["val"]["documents"] == 2
    assert peak - small_peak < 4 << 20, (peak, small_peak)  # the 40 MB line was never held whole
