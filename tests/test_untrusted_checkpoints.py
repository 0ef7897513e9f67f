"""A checkpoint is data: reading one, in any layout, runs nothing in it, through every script.

Each attack plants a payload that writes a marker file if it ever runs; the scripts must either refuse the
checkpoint in one line or pass it by, and the marker must never appear."""

import dataclasses
import pickle
import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from helpers import TINY, run, script
from lib import checkpoint as ckpt
from lib import dcp_metadata, resume
from lib.optim import build_optimizers
from lib.settings import defaults


class Payload:
    # pickled as a call of exec(code): what any pickle may name, and an unrestricted unpickler calls
    def __init__(self, code):
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


class Stealthy:
    # writes the marker, then hands back the genuine metadata: the script would go on as if nothing happened
    def __init__(self, marker, genuine):
        self.marker, self.genuine = marker, genuine

    def __reduce__(self):
        code = f"[open({self.marker!r}, 'w').write('ran'), __import__('pickle').loads({self.genuine!r})][1]"
        return eval, (code,)


def write_runs(folder):
    # a character dataset made by prepare.py (sample.py and export.py need its tokenizer), one tiny run on it in
    # files (out_dir/ckpt.pt), and the same state as a sharded folder (out_dir/ckpt/), written in this process
    # by checkpoint.save as an FSDP run would write it
    corpus, data_dir = folder / "corpus", folder / "data"
    corpus.mkdir()
    for i in range(20):
        (corpus / f"doc{i}.txt").write_text(f"hello world number {i}.\n" * 50)
    prepared = script("prepare.py", corpus, f"--out_dir={data_dir}", "--tokenizer=char")
    assert prepared.returncode == 0, prepared.stderr
    files, sharded = folder / "files", folder / "sharded"
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={files}", "--max_iters=2", "--eval_interval=2")
    saved = resume.load_checkpoint(str(files / "ckpt.pt"))
    model = resume.model_from_checkpoint(saved)
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                  "learning_rate": 1e-2, "weight_decay": 0.1}, "cpu")
    optimizers[0].load_state_dict(saved["optimizer"])
    state = {k: v for k, v in saved.items() if k not in ("model", "optimizer", "more_optimizers")}
    sharded.mkdir()
    ckpt.save(str(sharded), state, model, optimizers, sharded=True, lora=False)


@pytest.fixture(scope="session")
def runs(shared):
    return shared("untrusted-runs", write_runs)


def copy_run(runs, name, tmp_path):
    out = tmp_path / name
    shutil.copytree(runs / name, out)
    return out


def run_script(which, out_dir, tmp_path, data_dir):
    # the script reading out_dir's checkpoint, as a user would run it
    if which == "train":
        return run(*TINY, f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--init_from=resume", "--max_iters=3",
                   "--eval_interval=2", check=False)
    if which == "export":
        return script("export.py", f"--out_dir={out_dir}", f"--to={tmp_path / 'exported'}")
    if which == "eval":
        return script("eval.py", f"--out_dir={out_dir}", "--batch_size=2")
    return script("sample.py", f"--out_dir={out_dir}", "--num_samples=1", "--max_new_tokens=4")


def assert_refused_in_one_line(done, what):
    assert done.returncode != 0, done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert what in last and "refus" in last, done.stderr[-2000:]


SCRIPTS = ["sample", "eval", "export", "train"]


def test_a_genuine_sharded_checkpoint_reads_through_the_checked_metadata(runs):
    weights = resume.read_sharded(str(runs / "sharded" / "ckpt"))
    files = resume.load_checkpoint(str(runs / "files" / "ckpt.pt"))["model"]
    assert weights.keys() == files.keys() and all(torch.equal(weights[k], files[k]) for k in files)


@pytest.mark.parametrize("which", SCRIPTS)
def test_a_metadata_payload_never_runs(runs, tmp_path, which):
    out = copy_run(runs, "sharded", tmp_path)
    marker = tmp_path / "marker"
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(Payload(f"open({str(marker)!r}, 'w').write('ran')"), f)
    done = run_script(which, out, tmp_path, runs / "data")
    assert not marker.exists()
    assert_refused_in_one_line(done, "builtins.exec")


@pytest.mark.parametrize("which", SCRIPTS)
def test_a_stealthy_payload_that_returns_the_genuine_metadata_never_runs(runs, tmp_path, which):
    out = copy_run(runs, "sharded", tmp_path)
    marker = tmp_path / "marker"
    genuine = (out / "ckpt" / ".metadata").read_bytes()
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(Stealthy(str(marker), genuine), f)
    done = run_script(which, out, tmp_path, runs / "data")
    assert not marker.exists()
    assert_refused_in_one_line(done, "builtins.eval")


def test_a_bytes_entry_is_refused_where_dcp_would_unpickle_it_in_full(runs, tmp_path):
    # DCP reads an entry its metadata calls bytes with torch.load(weights_only=False): a genuine-looking
    # .metadata that turns one optimizer tensor into bytes, pointing at a pickled payload, would run it on resume
    out = copy_run(runs, "sharded", tmp_path)
    marker = tmp_path / "marker"
    with open(out / "ckpt" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    name = next(k for k in metadata.state_dict_metadata if k.startswith("optimizer."))
    metadata.state_dict_metadata[name] = BytesStorageMetadata()
    torch.save(Payload(f"open({str(marker)!r}, 'w').write('ran')"), out / "ckpt" / "evil.distcp")
    size = (out / "ckpt" / "evil.distcp").stat().st_size
    metadata.storage_data[MetadataIndex(name)] = _StorageInfo("evil.distcp", 0, size)
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    done = run_script("train", out, tmp_path, runs / "data")
    assert not marker.exists()
    assert_refused_in_one_line(done, "BytesStorageMetadata")


def test_metadata_pointing_outside_its_folder_is_refused(runs, tmp_path):
    out = copy_run(runs, "sharded", tmp_path)
    with open(out / "ckpt" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    key = next(iter(metadata.storage_data))
    (tmp_path / "elsewhere.distcp").write_bytes((out / "ckpt" / "__0_0.distcp").read_bytes())
    metadata.storage_data[key] = _StorageInfo("../../elsewhere.distcp", 0, 1)
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match=r"points at '../../elsewhere.distcp', not a file of its own folder"):
        resume.read_sharded(str(out / "ckpt"))
    # or at a place no file has (an offset of another type, a negative one): refused before a reader adds it up
    for offset in ("0", -8):
        metadata.storage_data[key] = _StorageInfo("__0_0.distcp", offset, 1)
        with open(out / "ckpt" / ".metadata", "wb") as f:
            pickle.dump(metadata, f)
        with pytest.raises(ValueError, match=r"points at '__0_0.distcp', not a file of its own folder"):
            dcp_metadata.CheckedReader(str(out / "ckpt"))


def test_a_tensor_with_more_values_than_its_file_stores_is_refused(runs, tmp_path):
    # a view with a stride of 0 is saved as one value: a few KB on disk for a weight of any size, made whole in memory
    # by the first op on it (weights_only loads it): refused by what the file stores, before any op
    out = copy_run(runs, "files", tmp_path)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(1).expand_as(state["model"][name])
    moments = next(iter(state["optimizer"]["state"].values()))
    moments["exp_avg"] = torch.zeros(1).expand_as(moments["exp_avg"])
    torch.save(state, out / "ckpt.pt")
    saved = resume.load_checkpoint(str(out / "ckpt.pt"))
    with pytest.raises(ValueError, match=rf"the checkpoint's {re.escape(name)} is \(.*\), more values than the file"):
        resume.model_from_checkpoint(saved)
    params = [torch.zeros(t.shape) for t in (m["exp_avg"] for m in saved["optimizer"]["state"].values())]
    with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' for parameter \d+ is \(.*\), more values"):
        resume.check_moments(saved["optimizer"], params, "ckpt.pt")


def test_a_checkpoint_with_a_compressed_part_is_refused_before_it_is_inflated(runs, tmp_path):
    # torch.save stores its parts as they are: a deflated one (a few MB of zeros that inflate to GBs) is no checkpoint
    # of ours, refused before the CRCs' check would inflate it
    import zipfile
    out = copy_run(runs, "files", tmp_path)
    with zipfile.ZipFile(out / "ckpt.pt", "a", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("ckpt/data/zeros", bytes(1 << 20))
    with pytest.raises(ValueError, match=r"holds a compressed part, ckpt/data/zeros, which torch.save never writes"):
        resume.load_checkpoint(str(out / "ckpt.pt"))


def test_metadata_saying_a_tensor_is_larger_than_its_shards_hold_is_refused(runs, tmp_path):
    # read_sharded makes each tensor whole before reading it: a .metadata that swells one (20 KB of shards for a
    # 32 GB weight) is refused by the bytes its shards store, before anything is allocated
    out = copy_run(runs, "sharded", tmp_path)
    with open(out / "ckpt" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    entry = metadata.state_dict_metadata["model.wte.weight"]
    entry.size = torch.Size([1 << 16, *entry.size[1:]])
    entry.chunks = [dataclasses.replace(entry.chunks[0], offsets=torch.Size([0] * len(entry.size)), sizes=entry.size)]
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match=r"model\.wte\.weight is said to be \(65536, \d+\) of torch\.float32, which "
                                         r"its shards do not hold"):
        resume.read_sharded(str(out / "ckpt"))


@pytest.mark.parametrize("damage", ["no chunks", "a chunk twice", "past its size", "no size", "countless chunks"])
def test_metadata_whose_chunks_do_not_cover_a_tensor_once_is_refused(runs, tmp_path, damage):
    # the rest of a tensor its chunks leave out would be what torch.empty left in memory: weights read silently wrong
    out = copy_run(runs, "sharded", tmp_path)
    with open(out / "ckpt" / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    entry = metadata.state_dict_metadata["model.wte.weight"]
    chunk = entry.chunks[0]
    entry.chunks = {"no chunks": [], "a chunk twice": [chunk, chunk], "past its size": [
        dataclasses.replace(chunk, offsets=torch.Size([1, *chunk.offsets[1:]]))], "no size": entry.chunks,
        "countless chunks": [chunk] * (dcp_metadata.MAX_CHUNKS + 1)}[damage]
    if damage == "no size":
        entry.size = None
    elif damage == "a chunk twice":  # as many values as the tensor has, in two halves laid over each other
        half = dataclasses.replace(chunk, sizes=torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]]))
        entry.chunks = [half, half] if chunk.sizes[0] % 2 == 0 else [half, half, half]
    with open(out / "ckpt" / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(ValueError, match=r"\.metadata: the shards of model\.wte\.weight (do|have|hold|overlap|are)"):
        resume.read_sharded(str(out / "ckpt"))


def test_chunks_are_compared_along_the_dim_they_are_laid_along():
    # a tensor's chunks are each compared with those that meet it along the dim their starts vary most along: a row
    # of 16,384 columns (or a grid of cells) is read in a second, where comparing along dim 0 alone took hours;
    # an overlap is found all the same
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    def entry(size, cells):
        return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size),
                                     [ChunkStorageMetadata(torch.Size(at), torch.Size(extent)) for at, extent in cells])
    n = dcp_metadata.MAX_CHUNKS
    assert dcp_metadata.untiled(entry([1, n], [((0, i), (1, 1)) for i in range(n)])) is None
    grid = [((r, c), (1, 1)) for r in range(128) for c in range(128)]
    assert dcp_metadata.untiled(entry([128, 128], grid)) is None
    assert dcp_metadata.untiled(entry([128, 128], [*grid[:-2], ((0, 0), (1, 2))])) == "overlap at (0, 0)"
    assert dcp_metadata.untiled(entry([1, n + 1], [((0, i), (1, 1)) for i in range(n + 1)])).startswith("are 16,385")


@pytest.mark.parametrize("which", SCRIPTS)
def test_a_planted_old_folder_claiming_a_later_step_is_never_taken_over_ckpt_pt(runs, tmp_path, which):
    # ckpt.old/ is what a sharded save killed between its two renames leaves; an out_dir of files never has
    # one, and its claimed step is no reason to read it: the genuine ckpt.pt is read, the payload never
    out = copy_run(runs, "files", tmp_path)
    shutil.copytree(runs / "sharded" / "ckpt", out / "ckpt.old")
    state = torch.load(out / "ckpt.old" / "state.pt", weights_only=True)
    torch.save({**state, "iter_num": 10**6}, out / "ckpt.old" / "state.pt")
    marker = tmp_path / "marker"
    genuine = (out / "ckpt.old" / ".metadata").read_bytes()
    with open(out / "ckpt.old" / ".metadata", "wb") as f:
        pickle.dump(Stealthy(str(marker), genuine), f)
    assert ckpt.find_checkpoint(str(out / "ckpt.pt")) == str(out / "ckpt.pt")
    done = run_script(which, out, tmp_path, runs / "data")
    assert not marker.exists()
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_old_folder_is_taken_only_without_its_newer_one(runs, tmp_path):
    # beside a whole ckpt/, a ckpt.old/ is the one publish set aside (it removes it next), whatever it claims
    out = copy_run(runs, "sharded", tmp_path)
    shutil.copytree(out / "ckpt", out / "ckpt.old")
    state = torch.load(out / "ckpt.old" / "state.pt", weights_only=True)
    torch.save({**state, "iter_num": 10**6}, out / "ckpt.old" / "state.pt")
    assert ckpt.find_checkpoint(str(out / "ckpt.pt")) == str(out / "ckpt")
    shutil.rmtree(out / "ckpt")  # a kill between publish's two renames: the old one is all there is
    assert ckpt.find_checkpoint(str(out / "ckpt.pt")) == str(out / "ckpt.old")


def flip_a_byte_of(path, part="data/0"):
    # one bit changed inside a tensor's bytes of a torch.save zip, as bit rot on a disk would change it
    import zipfile
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(part))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_length, extra_length = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + name_length + extra_length + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("which", SCRIPTS)
def test_a_flipped_bit_in_a_checkpoint_is_found_by_every_reader(runs, tmp_path, which):
    out = copy_run(runs, "files", tmp_path)
    flip_a_byte_of(out / "ckpt.pt", "data/1")  # the embedding's (data/0: the random state, which a resume alone reads)
    damaged = (out / "ckpt.pt").read_bytes()
    done = run_script(which, out, tmp_path, runs / "data")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert re.search(rf"{re.escape(str(out / 'ckpt.pt'))} is damaged: its part \w+/data/1 is not the bytes that "
                     rf"were saved \(its checksum differs\); use another checkpoint, e.g. ckpt_best.pt or a "
                     rf"ckpt_NNNNNNN.pt$", done.stderr.strip().splitlines()[-1]), done.stderr[-2000:]
    assert (out / "ckpt.pt").read_bytes() == damaged and not (tmp_path / "exported").exists()


def test_a_reader_of_the_weights_checks_their_parts_and_never_reads_the_moments(tmp_path):
    # sample.py, eval.py and export.py map a checkpoint and read its weights: the parts that hold them are checked
    # (with the pickle), the optimizer's moments (twice the weights under AdamW) never read; a resume checks every part
    import zipfile
    import zlib
    weight, moment, path = torch.randn(64, 32), 3 * torch.randn(64, 32), tmp_path / "ckpt.pt"

    def part_of(t):  # the name of the part that holds t's bytes
        with zipfile.ZipFile(path) as archive:
            return next(i.filename for i in archive.infolist() if i.CRC == zlib.crc32(t.numpy().tobytes()))

    for damaged, how in ((moment, "flip"), (weight, "flip"), (weight, "zero")):
        # (zero: the weight's bytes all zeros, as a zeroed page leaves them: those of another part, of a zero weight)
        torch.save({"model": {"w": weight, "tied": weight, "b": torch.ones(5), "zero": torch.zeros(64, 32)},
                    "optimizer": {"state": {0: {"exp_avg": moment}}}}, path)
        if how == "flip":
            flip_a_byte_of(path, part_of(damaged))
        else:
            data = path.read_bytes()
            at = data.index(weight.numpy().tobytes())
            path.write_bytes(data[:at] + bytes(weight.nbytes) + data[at + weight.nbytes:])
        said = rf"{re.escape(str(path))} is damaged: its part {re.escape(part_of(damaged))} is not the bytes"
        with pytest.raises(resume.UserError, match=said):
            resume.load_checkpoint(str(path))
        if damaged is weight:
            with pytest.raises(resume.UserError, match=said):
                resume.load_checkpoint(str(path), mmap=True, verify="model")
        else:
            assert torch.equal(resume.load_checkpoint(str(path), mmap=True, verify="model")["model"]["w"], weight)


@pytest.mark.parametrize("name, value", [("iter_num", "5"), ("iter_num", -1), ("best_val_loss", None),
                                         ("evaluated", 1), ("config", ["not", "a", "dict"]),
                                         ("rng", [{"cpu": "not a random state"}]), ("rng", "x"),
                                         ("optimizer", {"state": [], "param_groups": []}),
                                         ("more_optimizers", {"no": "list"}), ("world_size", 0), ("scaler", []),
                                         ("data_fingerprint", {"train": 1}), ("pretrained", 3)])
def test_a_damaged_value_in_a_checkpoint_is_named_before_it_is_used(runs, tmp_path, name, value):
    # a value of the wrong kind, as a hand edit or a damaged file leaves it: the resume names it in one line
    out = copy_run(runs, "files", tmp_path)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save({**state, name: value}, out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    done = run_script("train", out, tmp_path, runs / "data")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"holds {name}=" in done.stderr and "which train.py never saves: use another checkpoint" in done.stderr
    assert (out / "ckpt.pt").read_bytes() == before


@pytest.mark.parametrize("part, name, value, says", [
    ("config", "dtype", "nonsense", None), ("config", "lora_base_dtype", "zzz", None),
    ("config", "block_size", "32", None), ("config", "eval_stride", "x", None), ("model_args", "family", "gpt2", None),
    ("model_args", "lora_rank", "4", None), ("config", "sequences", "bogus", None), ("config", "doc_mask", 1, None),
    ("model_args", "lora_rank", 4, "holds a LoRA run's adapters but not the base folder they go on (pretrained)")])
def test_a_setting_the_readers_take_from_a_checkpoint_is_named_if_damaged(runs, tmp_path, part, name, value, says):
    # sample.py, eval.py and export.py read back the run's dtype, block_size, family...: a hand-edited one was a
    # traceback (torch has no attribute 'nonsense'; export's KeyError 'gpt2'; a LoRA run with no base: stat(None))
    out = copy_run(runs, "files", tmp_path)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save({**state, part: {**state[part], name: value}}, out / "ckpt.pt")
    for which in ("sample", "eval", "export"):
        done = run_script(which, out, tmp_path, runs / "data")
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert (says or f"holds {name}={str(value)!r}, which train.py never saves: use another") in done.stderr, \
            (which, done.stderr[-2000:])


@pytest.mark.parametrize("layout", ["files", "sharded"])
def test_an_optimizer_moment_of_another_shape_is_refused_in_one_line(runs, tmp_path, layout):
    # Adam's first moment of one parameter cut short: loaded as it is, the optimizer's first step would fail
    # inside torch (an internal assert, or worse); a file read into shards (FSDP) is checked the same way
    out = copy_run(runs, "files", tmp_path)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"] = state["optimizer"]["state"][0]["exp_avg"][:1]
    torch.save(state, out / "ckpt.pt")
    before = (out / "ckpt.pt").read_bytes()
    fsdp = ["--fsdp=True"] if layout == "sharded" else []
    done = run(*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--init_from=resume", "--max_iters=3",
               "--eval_interval=2", *fsdp, check=False)
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "holds an optimizer state 'exp_avg' for parameter 0 that does not fit the model" in done.stderr
    assert (out / "ckpt.pt").read_bytes() == before


@pytest.mark.parametrize("which", ["sample", "eval", "export"])
@pytest.mark.parametrize("name, value", [("config", "x"), ("config", {"data_dir": 5}), ("data_dir", 5),
                                         ("pretrained", 3)])
def test_a_damaged_value_is_named_by_every_reader_of_the_run(runs, tmp_path, which, name, value):
    out = copy_run(runs, "files", tmp_path)
    state = torch.load(out / "ckpt.pt", weights_only=True)
    torch.save({**state, name: value}, out / "ckpt.pt")
    done = run_script(which, out, tmp_path, runs / "data")
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"holds {name}=" in done.stderr and "which train.py never saves: use another checkpoint" in done.stderr
