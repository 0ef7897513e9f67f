"""One writer per folder, files that agree with meta.json, and honest stops and resumes.

prepare.py and train.py lock the folder they write (files.py); a second writer is refused in one line naming the
first. export.py --overwrite replaces only an earlier export. A diverged run stops with a checkpoint from before
the update that broke it, and a resume cannot change the model's shape."""

import fcntl
import json
import os
import shutil
import sys
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from helpers import ROOT, TINY, new_python, on_cpu, poisoned_config, run, script, train_refusal
from test_untrusted_checkpoints import runs  # noqa: F401 (a fixture: a prepared dataset and a tiny run on it)


@contextmanager
def held(folder, writer):
    # another process's lock on folder, as lock.py takes it: flock on folder/.lock, which names the writer
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write(f"{writer} (pid {os.getpid()})\n")
        f.flush()
        yield


def assert_one_line(done, *parts):
    assert done.returncode != 0, done.stdout[-2000:]
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr[-3000:]
    assert all(part in done.stderr for part in parts), done.stderr


def corpus(folder):
    folder.mkdir()
    for i in range(10):
        (folder / f"doc{i}.txt").write_text(f"hello world number {i}.\n" * 20)
    return folder


def test_a_second_prepare_into_a_folder_being_written_is_refused_naming_the_first(tmp_path):
    data = tmp_path / "data"
    with held(data, "prepare.py"):
        done = script("prepare.py", corpus(tmp_path / "corpus"), f"--out_dir={data}", "--tokenizer=char")
        assert_one_line(done, f"{data} is being written by prepare.py (pid {os.getpid()})")
        assert sorted(os.listdir(data)) == [".lock"]  # nothing of its own was written there
    done = script("prepare.py", tmp_path / "corpus", f"--out_dir={data}", "--tokenizer=char")
    assert done.returncode == 0, done.stderr  # the lock file the first left behind locks nothing
    assert sorted(os.listdir(data)) == ["meta.json", "train.bin", "val.bin", "vocab.json"]  # none left


def test_a_second_train_into_an_out_dir_being_written_is_refused_naming_the_first(runs, tmp_path):
    out = tmp_path / "out"
    args = [*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2"]
    with held(out, "train.py"):
        done = run(*args, check=False)
        assert_one_line(done, f"{out} is being written by train.py (pid {os.getpid()})")
        assert sorted(os.listdir(out)) == [".lock"]
    run(*args)
    assert ".lock" not in os.listdir(out)  # a run that ends removes its lock file


def test_token_files_must_hold_as_many_tokens_as_meta_json_counts(runs, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(runs / "data", data)
    args = [*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'out'}", "--max_iters=1"]
    meta = json.loads((data / "meta.json").read_text())
    with open(data / "train.bin", "ab") as f:  # another run's tokens appended: whole tokens, the right dtype
        np.arange(100, dtype=np.uint16).tofile(f)
    said = train_refusal(*args)  # train.py's checks, in process
    assert f"{data / 'train.bin'} holds {meta['train']['tokens'] + 100:,} uint16 tokens where meta.json says " \
           f"{meta['train']['tokens']:,}" in said and "re-run prepare.py" in said
    shutil.copy(runs / "data" / "train.bin", data / "train.bin")
    (data / "meta.json").write_text(json.dumps({**meta, "dtype": "uint8"}))  # a uint16 file read as uint8
    assert "dtype uint8 is not uint16 or uint32" in train_refusal(*args)  # refused before the lengths are compared


@pytest.mark.slow
def test_export_overwrite_replaces_only_an_earlier_export(runs, tmp_path):
    out = runs / "files"
    exported = tmp_path / "exported"
    for _ in range(2):  # the second replaces the first
        done = script("export.py", f"--out_dir={out}", f"--to={exported}", "--overwrite")
        assert done.returncode == 0, done.stderr
    data = tmp_path / "data"
    shutil.copytree(runs / "data", data)
    before = sorted(os.listdir(data))
    done = script("export.py", f"--out_dir={out}", f"--to={data}", "--overwrite")
    assert_one_line(done, f"{data} holds meta.json, which export.py does not write", "choose another --to")
    assert sorted(os.listdir(data)) == before
    (exported / "notes.txt").write_text("mine")  # an export a user added to is theirs now
    done = script("export.py", f"--out_dir={out}", f"--to={exported}", "--overwrite")
    assert_one_line(done, "holds notes.txt, which export.py does not write")
    assert (exported / "notes.txt").read_text() == "mine"
    # names beside --to are the user's (an export killed before never blocks the next), and a link is refused:
    # replaced, the link would go and the folder it names keep the old export
    again, link = tmp_path / "again", tmp_path / "link"
    for name in ("again.export-tmp", "again.export-old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine").write_text("mine")
    for _ in range(2):
        done = script("export.py", f"--out_dir={out}", f"--to={again}", "--overwrite")
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "again.export-tmp" / "mine").exists() and (tmp_path / "again.export-old" / "mine").exists()
    mask = os.umask(0)
    os.umask(mask)
    assert (again.stat().st_mode & 0o777) == 0o777 & ~mask  # as any folder made here, not tempfile's 0700
    link.symlink_to(again)
    done = script("export.py", f"--out_dir={out}", f"--to={link}", "--overwrite")
    assert_one_line(done, f"{link} is a link; give the folder it names as --to")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "again.export-old", "again.export-tmp", "data",
                                                           "exported", "link"]


def test_export_to_the_current_folder_ends_in_one_line_and_leaves_nothing(runs, tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    (here / "train.py").write_text("# a project of the user's\n")
    for overwrite in ([], ["--overwrite"]):
        done = script(ROOT / "export.py", f"--out_dir={runs / 'files'}", "--to=.", *overwrite, cwd=here)
        assert_one_line(done, "choose another --to")
        assert sorted(os.listdir(here)) == ["train.py"] and sorted(os.listdir(tmp_path)) == ["here"]


def test_a_diverged_run_stops_with_the_checkpoint_from_before_the_update_that_broke_it(runs, tmp_path):
    # learning_rate=1e9 from step 2: update 3 is finite and wrecks the weights, every gradient after it is NaN
    out = tmp_path / "out"
    shutil.copytree(runs / "files", out)
    before = torch.load(out / "ckpt.pt", weights_only=True)
    assert before["iter_num"] == 2
    done = run(*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--init_from=resume", "--max_iters=20",
               "--eval_interval=1", "--max_skipped_steps=3", "--learning_rate=1e9", check=False)
    assert_one_line(done, "3 updates in a row had a non-finite loss or gradient",
                    f"{out / 'ckpt.pt'}, from step 2, is the last good state")
    after = torch.load(out / "ckpt.pt", weights_only=True)
    assert after["iter_num"] == 2
    assert all(torch.equal(after["model"][k], v) for k, v in before["model"].items())


def resumed_poisoned(runs, tmp_path, name, body, launch):
    # the shared run's files resumed to step 4 under a config file that breaks training (helpers.poisoned_config),
    # launched by launch(train.py's arguments) -> (its result, the out_dir, ckpt.pt's bytes before)
    out = tmp_path / "out"
    shutil.copytree(runs / "files", out)
    before = (out / "ckpt.pt").read_bytes()
    config = poisoned_config(tmp_path / f"{name}.py", body)
    done = launch([*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--init_from=resume", "--max_iters=4",
                   "--eval_interval=2", config])
    return done, out, before


def test_a_run_whose_last_update_failed_saves_nothing_and_says_so(runs, tmp_path):
    # the last update's gradient is NaN: the weights at the end gave it, so they are not saved over the last good
    # state (which the resume came from), and the run ends in one line with a non-zero exit
    done, out, before = resumed_poisoned(runs, tmp_path, "nan_last", (
        "def _nan(x, w, t, ignore_index=-1):\n"
        "    _calls[0] += not _is_fake(x)\n"
        "    return _loss(x, w, t, ignore_index) * (float('nan') if _calls[0] == 2 else 1.0)\n"
        "_m.linear_cross_entropy = _nan\n"), lambda args: run(*args, check=False))
    assert_one_line(done, "1 update in a row had a non-finite loss or gradient",
                    f"{out / 'ckpt.pt'}, from step 2, is the last good state")
    assert (out / "ckpt.pt").read_bytes() == before
    assert sorted(p.name for p in out.glob("ckpt*")) == sorted(p.name for p in (runs / "files").glob("ckpt*"))


def test_an_improvement_whose_held_back_save_is_dropped_counts_as_none(runs, tmp_path):
    # step 1's val loss is the best, but update 2's gradient is NaN: its checkpoint is dropped, and so is its lower
    # best_val_loss. Steps 2 and 3 keep step 1's weights (update 2 skipped, update 3 at lr 0), whose gradients are
    # finite: step 2 is saved as ckpt_best, with no note that none was written
    out = tmp_path / "out"
    config = poisoned_config(tmp_path / "nan_second.py", (
        "def _nan(x, w, t, ignore_index=-1):\n"
        "    _calls[0] += not _is_fake(x)\n"
        "    return _loss(x, w, t, ignore_index) * (float('nan') if _calls[0] == 2 else 1.0)\n"
        "_m.linear_cross_entropy = _nan\n"))
    done = run(*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--max_iters=3", "--eval_interval=1",
               "--warmup_iters=0", "--lr_decay_iters=2", "--min_lr=0", config)
    assert "iter 2: skipped" in done.stdout and "no ckpt_best" not in done.stdout
    best, last = (torch.load(out / name, weights_only=True) for name in ("ckpt_best.pt", "ckpt.pt"))
    assert best["iter_num"] == 2 and last["best_val_loss"] == best["best_val_loss"]
    assert last["evals_without_gain"] == 1


@pytest.mark.slow  # new Pythons, each importing torch: ~25 s
def test_weights_that_hold_a_nan_are_never_written(runs, tmp_path):
    # an optimizer step that leaves a NaN in the weights (its loss and gradient were finite): the run's last save
    # refuses them in one line, and ckpt.pt stays the last good state. In a new Python: the patch is of torch's
    # own class, which a run in this process would leave patched
    done, out, before = resumed_poisoned(runs, tmp_path, "nan_weights", (
        "def _poison(self, *args, **kwargs):\n"
        "    done = _step(self, *args, **kwargs)\n"
        "    first = self.param_groups[0]['params'][0]\n"
        "    _calls[0] += not _is_fake(first)\n"
        "    if _calls[0] == 2 and not _is_fake(first):\n"
        "        with _torch.no_grad():\n"
        "            first.view(-1)[0] = float('nan')\n"
        "    return done\n"
        "_torch.optim.AdamW.step = _poison\n"), lambda args: new_python("train.py", *on_cpu(args)))
    assert_one_line(done, "the weights hold a NaN or an infinite value at step 4: not saved",
                    f"{out / 'ckpt.pt'}, from step 2, is the last good state")
    assert (out / "ckpt.pt").read_bytes() == before


def test_a_resume_with_another_model_shape_is_refused(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs / "files", out)
    said = train_refusal(*TINY, f"--data_dir={runs / 'data'}", f"--out_dir={out}", "--init_from=resume",
                         "--max_iters=4", "--n_embd=64", "--n_layer=3")  # train.py's checks, in process
    assert "holds a model of n_layer=2, n_embd=32, not n_layer=3, n_embd=64" in said
    assert "resume with the checkpoint's shape" in said


def test_a_data_folder_prepared_again_with_another_tokenizer_is_refused_by_the_run(runs, tmp_path):
    # the run's data prepared again, with the same kind of tokenizer learned from other text: the same ids now
    # mean other characters, and every reader of the run says so in one line instead of going on with them
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(runs / "data", data)
    run(*TINY, f"--data_dir={data}", f"--out_dir={out}", "--max_iters=2", "--eval_interval=2")
    other = tmp_path / "other"
    other.mkdir()
    for i in range(10):
        (other / f"doc{i}.txt").write_text(f"HELLO, WORLD: NUMBER {i}!\n" * 20)  # other characters
    done = script("prepare.py", other, f"--out_dir={data}", "--tokenizer=char", "--overwrite")
    assert done.returncode == 0, done.stderr
    before = (out / "ckpt.pt").read_bytes()
    said = train_refusal(*TINY, f"--data_dir={data}", f"--out_dir={out}", "--max_iters=4", "--eval_interval=2",
                         "--init_from=resume")
    assert f"{data} was prepared with another tokenizer than the one {out / 'ckpt.pt'} was trained on" in said
    for reader in (["sample.py", "--num_samples=1", "--max_new_tokens=4"], ["eval.py"],
                   ["export.py", f"--to={tmp_path / 'exported'}"]):
        done = script(reader[0], f"--out_dir={out}", *reader[1:])
        assert_one_line(done, f"{data} was not prepared with the tokenizer {out / 'ckpt.pt'} was trained with",
                        "pass --data_dir=DIR, a dataset prepared as the run's was")
    assert (out / "ckpt.pt").read_bytes() == before and not (tmp_path / "exported").exists()


def test_eval_on_an_empty_val_split_and_sample_on_a_huge_prompt_file_end_in_one_line(runs, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(runs / "data", data)
    shutil.copytree(runs / "files", out)
    (data / "val.bin").write_bytes(b"")
    done = script("eval.py", f"--out_dir={out}", f"--data_dir={data}")
    assert_one_line(done, f"{data / 'val.bin'} is empty", "prepare the data with --val_fraction above 0")
    # a prompt file past the bound is refused before it is read whole (memory) or encoded (gigabytes of ids)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello world number 1.\n" * 50_000)  # 1.1 M characters
    done = script("sample.py", f"--out_dir={out}", f"--start=FILE:{prompt}", "--num_samples=1")
    assert_one_line(done, f"the prompt file {prompt} is longer than 1,048,576 characters: give the part that matters")


def test_an_export_whose_destination_cannot_be_written_ends_in_one_line_and_leaves_nothing(runs, tmp_path,
                                                                                          monkeypatch):
    (tmp_path / "a_file").write_text("mine\n")
    for to in (tmp_path / "a_file" / "model", tmp_path / "a_file" / "in" / "model.gguf"):
        done = script("export.py", f"--out_dir={runs / 'files'}", f"--to={to}")
        assert_one_line(done, f"{tmp_path / 'a_file'} is not a folder; choose another --to")
    # a missing folder above --to is made (models/ in a fresh checkout), and taken away again by an export that fails
    for to in (tmp_path / "missing" / "new" / "model", tmp_path / "missing" / "model.gguf"):
        done = script("export.py", f"--out_dir={runs / 'files'}", "--ckpt=no_such.pt", f"--to={to}")
        assert_one_line(done, "no checkpoint at")
    assert sorted(os.listdir(tmp_path)) == ["a_file"]
    done = script("export.py", f"--out_dir={runs / 'files'}", f"--to={tmp_path / 'models' / 'mine'}")
    assert done.returncode == 0 and (tmp_path / "models" / "mine" / "config.json").is_file()
    # the disk fills while the new export is written over an earlier one: one line, the earlier one as it was
    import export
    to = tmp_path / "exported"
    assert script("export.py", f"--out_dir={runs / 'files'}", f"--to={to}").returncode == 0
    before = {p.name: p.read_bytes() for p in to.iterdir()}

    def full_disk(model, folder, ids=None):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "model.safetensors"), "wb") as f:
            f.write(bytes(1000))
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(export, "save_pretrained", full_disk)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # (export.main installs its one-line hook)
    with pytest.raises(ValueError, match=f"^cannot write --to={to} \\(No space left on device\\); nothing was left "
                                         f"there: make room, or choose another --to$"):
        export.main([f"--out_dir={runs / 'files'}", f"--to={to}", "--overwrite"])
    assert {p.name: p.read_bytes() for p in to.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["a_file", "exported", "models"]


def check_stopped_export(run_dir, to):
    # a scheduler's SIGTERM once the new export is written whole beside --to, not yet renamed: the earlier export
    # stays as it was, and the new one's temporary copy (a model's size) goes; one line. A finished export's files
    # are readable by others, as any new file (huggingface_hub writes its safetensors 0600). (test_gguf's too)
    args = [f"--out_dir={run_dir}", f"--to={to}"]
    assert script("export.py", *args).returncode == 0
    files = sorted(to.iterdir()) if to.is_dir() else [to]
    mask = os.umask(0)
    os.umask(mask)
    assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in files), [(f.name, oct(f.stat().st_mode))
                                                                          for f in files]
    before = {f.name: f.read_bytes() for f in files}
    slow = ("import os, runpy, signal, sys\n"
            "import lib.hf, lib.gguf_export\n"
            "def stopped(real):\n"
            "    def write(*args, **kwargs):\n"
            "        real(*args, **kwargs)\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return write\n"
            "lib.hf.save_pretrained = stopped(lib.hf.save_pretrained)\n"
            "lib.gguf_export.write_gguf = stopped(lib.gguf_export.write_gguf)\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path('export.py', run_name='__main__')\n")
    done = new_python("-c", slow, "export.py", *args, "--overwrite", "--dtype=float32")
    assert_one_line(done, "export.py: stopped by SIGTERM; its temporary files are removed, and an earlier export at "
                          "--to is as it was")
    assert sorted(p.name for p in to.parent.iterdir()) == [to.name]
    assert {f.name: f.read_bytes() for f in (sorted(to.iterdir()) if to.is_dir() else [to])} == before


@pytest.mark.slow  # SIGTERM to new Pythons
def test_an_export_stopped_by_sigterm_leaves_the_earlier_one_and_no_copy(runs, tmp_path):
    to = tmp_path / "model"
    check_stopped_export(runs / "files", to)
    # a SIGTERM once the new export is being renamed in: it finishes (the earlier one, set aside, goes), as said
    before = {f.name: f.read_bytes() for f in to.iterdir()}
    renamed = ("import os, runpy, signal, sys\n"
               "import lib.files\n"
               "real = lib.files.durable_replace\n"
               "def replace(src, dst):\n"
               "    real(src, dst)\n"
               "    os.kill(os.getpid(), signal.SIGTERM)\n"
               "lib.files.durable_replace = replace\n"
               "sys.argv = sys.argv[1:]\n"
               "runpy.run_path('export.py', run_name='__main__')\n")
    done = new_python("-c", renamed, "export.py", f"--out_dir={runs / 'files'}", f"--to={to}", "--overwrite")
    assert done.returncode == 0 and f"wrote a Hugging Face model to {to}" in done.stdout, done.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert {f.name: f.read_bytes() for f in to.iterdir()} == before


def test_data_prepared_again_while_the_run_starts_is_refused(tmp_path, monkeypatch):
    # prepare.py --overwrite finishing between train.py's reading of meta.json (and its checks of the token files)
    # and its opening of them (a checkpoint or a model loading meanwhile): the run would train on the new files read
    # as the old meta.json says (its dtype, vocabulary, counts), and keep a tokenizer fingerprint of neither
    import prepare
    import lib.start
    data = tmp_path / "data"
    (tmp_path / "a.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(3000)))
    (tmp_path / "b.txt").write_text("XYZ XZY\n" * 20000)
    prepare.main([str(tmp_path / "a.txt"), "--tokenizer=char", f"--out_dir={data}"])
    real = lib.start.begin

    def begin(*args, **kwargs):  # the folder is prepared again meanwhile
        prepare.main([str(tmp_path / "b.txt"), "--tokenizer=char", f"--out_dir={data}", "--overwrite"])
        return real(*args, **kwargs)
    monkeypatch.setattr(lib.start, "begin", begin)
    said = train_refusal(*TINY, f"--data_dir={data}", "--max_iters=2")
    assert "was prepared again while this run started" in said, said
    # eval.py: between its reading of meta.json and its opening of val.bin (its check of every id in val.bin lies
    # between)
    monkeypatch.setattr(lib.start, "begin", real)
    prepare.main([str(tmp_path / "a.txt"), "--tokenizer=char", f"--out_dir={data}", "--overwrite"])
    run(*TINY, f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    import lib.data
    opened = lib.data.Split

    def split(*args, **kwargs):
        prepare.main([str(tmp_path / "b.txt"), "--tokenizer=char", f"--out_dir={data}", "--overwrite"])
        return opened(*args, **kwargs)
    monkeypatch.setattr(lib.data, "Split", split)
    done = script("eval.py", f"--out_dir={tmp_path / 'run'}")
    assert done.returncode == 1 and "was prepared again while this run started" in done.stderr, done.stderr
    assert "val loss" not in done.stdout


def test_two_writers_of_one_file_each_write_it_whole_though_their_pids_are_equal(tmp_path):
    # eval.py --output and plot.py --to (replaced_whole) in two containers, whose processes' pids may be the same:
    # each writes a temporary file of its own, and the file is one of theirs, whole (the second's open had removed
    # the first's file, whose rename then failed)
    from lib.files import replaced_whole
    path = tmp_path / "scores.json"
    with replaced_whole(path) as first:
        first.write("the first's")
        with replaced_whole(path) as second:
            second.write("the second's")
        assert path.read_text() == "the second's"
    assert path.read_text() == "the first's" and os.listdir(tmp_path) == ["scores.json"]
