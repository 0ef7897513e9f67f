"""checkpoint.py and the atomic rename under it, in-process: no training run."""

import errno
import os
import re
import shutil
import stat
import time

import pytest
import torch

from lib import checkpoint as ckpt
from lib import resume
from lib import start
from lib.files import durable_replace
from lib.optim import build_optimizers
from lib.settings import defaults
from model import GPT, GPTConfig

SHAPE = dict(n_layer=1, n_head=2, n_embd=16, vocab_size=32, block_size=8)


def test_durable_replace_syncs_the_folder_that_holds_the_new_name(tmp_path, monkeypatch):
    # the rename itself must reach the disk: the folder is fsynced after it, not only the file before it
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)) or real_fsync(fd))
    (tmp_path / "a.tmp").write_text("new")
    (tmp_path / "a").write_text("old")
    durable_replace(tmp_path / "a.tmp", tmp_path / "a")
    assert (tmp_path / "a").read_text() == "new" and not (tmp_path / "a.tmp").exists()
    assert synced == [True]
    (tmp_path / "d.tmp").mkdir()
    durable_replace(tmp_path / "d.tmp", tmp_path / "d")  # a folder takes a free name the same way
    assert (tmp_path / "d").is_dir() and synced == [True, True]


def plain_run(out_dir, steps=1):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    optimizers = build_optimizers(model, {**defaults(), "optimizer": "adamw",
                                  "learning_rate": 1e-3, "weight_decay": 0.1}, "cpu")
    for _ in range(steps):
        x = torch.randint(0, 32, (2, 8))
        model(x, x)[1].backward()
        optimizers[0].step()
    state = {"iter_num": steps, "model_args": SHAPE, "config": {"data_dir": str(out_dir)}}
    ckpt.save(str(out_dir), state, model, optimizers, sharded=False, lora=False, improved=True, keep_last_n=1)
    return model, optimizers


def test_a_file_checkpoint_holds_torchs_own_state_dicts_and_its_copies(tmp_path):
    model, optimizers = plain_run(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_0000001.pt", "ckpt_best.pt"]
    saved = resume.load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert saved.keys() >= {"model", "optimizer", "more_optimizers", "iter_num"} and saved["more_optimizers"] == []
    assert all(torch.equal(saved["model"][k], v) for k, v in model.state_dict().items())
    assert saved["optimizer"]["param_groups"] == optimizers[0].state_dict()["param_groups"]
    rebuilt = resume.model_from_checkpoint(saved)
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in model.state_dict().items())
    # each name a file of its own: the bytes the same, and a copy over one (as going back to a step checkpoint
    # by hand does: cp writes into the file it replaces) leaves the others as they were
    names = ["ckpt.pt", "ckpt_0000001.pt", "ckpt_best.pt"]
    assert len({(tmp_path / n).read_bytes() for n in names}) == 1
    assert len({os.stat(tmp_path / n).st_ino for n in names}) == 3
    best = (tmp_path / "ckpt_best.pt").read_bytes()
    with open(tmp_path / "ckpt.pt", "r+b") as f:  # in place, as cp and torch.save over an existing file write
        torch.save({"another": torch.zeros(3)}, f)
    assert (tmp_path / "ckpt_best.pt").read_bytes() == best == (tmp_path / "ckpt_0000001.pt").read_bytes()


def test_where_a_run_begins_and_what_it_refuses(tmp_path):
    assert start.starting_point(str(tmp_path), "auto", None) == ("scratch", None)
    with pytest.raises(ValueError, match="no checkpoint at .* to resume from"):
        start.starting_point(str(tmp_path), "resume", None)
    with pytest.raises(ValueError, match="is not 'scratch', 'resume', 'auto' or a Hugging Face model folder"):
        start.starting_point(str(tmp_path), str(tmp_path / "nowhere"), None)
    plain_run(tmp_path)
    found = ckpt.find_checkpoint(str(tmp_path / "ckpt.pt"))
    with pytest.raises(ValueError, match=r"holds a run already \(ckpt.pt, ckpt_0000001.pt, ckpt_best.pt\)"):
        start.starting_point(str(tmp_path), "scratch", found)
    with pytest.raises(ValueError, match="is not a checkpoint of this train.py"):  # plain_run's state is partial
        start.starting_point(str(tmp_path), "auto", found)
    # a run's epoch checkpoints alone (ckpt.pt deleted to free room) are a run too, never trained over
    epochs = tmp_path / "epochs"
    epochs.mkdir()
    shutil.copy(tmp_path / "ckpt.pt", epochs / "ckpt_epoch_1.pt")
    (epochs / "ckpt_epoch_2").mkdir()  # a sharded run's
    for init_from in ("auto", "resume"):  # (resume: not "no checkpoint", as if there were nothing to copy)
        with pytest.raises(ValueError, match=r"holds a run already \(ckpt_epoch_1.pt, ckpt_epoch_2\): continue it "
                                             r"with --init_from=resume once one of them is copied to ckpt.pt \(a "
                                             r"sharded folder: to ckpt/\)"):
            start.starting_point(str(epochs), init_from, None)
    # done as told, the folder copied to ckpt/, it resumes
    shutil.copytree(epochs / "ckpt_epoch_2", epochs / "ckpt")
    (epochs / "ckpt" / "state.pt").write_bytes((epochs / "ckpt_epoch_1.pt").read_bytes())
    assert ckpt.find_checkpoint(str(epochs / "ckpt.pt")) == str(epochs / "ckpt")


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_keep_last_n_after_a_resume_from_an_earlier_step_keeps_the_new_steps(tmp_path, sharded):
    # a step checkpoint copied over ckpt to go back: the steps saved from there are the last keep_last_n, and those
    # of the run left behind count for nothing: a later one stays (saved over as the new run reaches its step), one
    # the new run passed without saving that step is not among its last (it was not the new run's 4 that went)
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    suffix = "" if sharded else ".pt"
    for i, step in enumerate((2, 4, 6, 3, 5)):  # back from 6 to 3: a file's time tells the runs apart, set here
        ckpt.save(str(tmp_path), {"iter_num": step}, model, optimizers, sharded=sharded, lora=0, keep_last_n=2)
        os.utime(tmp_path / f"ckpt_000000{step}{suffix}", (1e9 + i, 1e9 + i))  # (each later than the one before)
    # (the left-behind 4 is among the last 2 steps still: it goes at the next save)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt{suffix}", f"ckpt_0000003{suffix}", f"ckpt_0000004{suffix}",
                                            f"ckpt_0000005{suffix}", f"ckpt_0000006{suffix}"]
    assert resume.load_checkpoint(str(tmp_path / f"ckpt_0000005{suffix}"))["iter_num"] == 5
    ckpt.save(str(tmp_path), {"iter_num": 6}, model, optimizers, sharded=sharded, lora=0, keep_last_n=2)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt{suffix}", f"ckpt_0000005{suffix}", f"ckpt_0000006{suffix}"]


def test_an_old_copy_that_will_not_go_is_a_warning_once_the_save_is_whole(tmp_path, monkeypatch, capsys):
    # keep_last_n's oldest copy cannot be removed (a reader's NFS file in it): the save is whole already, and the run
    # goes on, saying so (it stopped with "could not write the checkpoint of step 3 ...; ckpt.pt from step 3 is intact")
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    retire = ckpt.retire

    def busy(path):
        if path.endswith("ckpt_0000001.pt"):
            raise OSError(errno.EBUSY, "Device or resource busy")
        retire(path)
    monkeypatch.setattr(ckpt, "retire", busy)
    for step in (1, 2, 3):
        ckpt.save(str(tmp_path), {"iter_num": step}, model, optimizers, sharded=False, lora=0, keep_last_n=2)
    assert f"warning: could not remove {tmp_path / 'ckpt_0000001.pt'}, an older step's copy (Device or resource " \
           f"busy): the run goes on; remove it by hand" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_0000001.pt", "ckpt_0000002.pt", "ckpt_0000003.pt"]
    assert ckpt.latest(str(tmp_path), False)[1] == 3


def test_an_old_folder_that_will_not_go_is_set_aside_and_never_stops_a_save(tmp_path, monkeypatch):
    # a sharded ckpt/ steps aside as ckpt.old/ at the next save; a reader's NFS file held open in it keeps it there
    # (the next save's rename onto it had failed: "could not write the checkpoint of step 3"): it is set aside under
    # a name of its own, and a save once the reader is done removes it
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    retire = ckpt.retire

    def busy(path):
        if os.path.exists(os.path.join(path, "held")):  # (the file a reader holds goes with its folder's renames)
            raise OSError(errno.EBUSY, "Device or resource busy")
        retire(path)
    monkeypatch.setattr(ckpt, "retire", busy)
    ckpt.save(str(tmp_path), {"iter_num": 1}, model, optimizers, sharded=True, lora=0)
    (tmp_path / "ckpt" / "held").write_text("")
    for step in (2, 3):
        ckpt.save(str(tmp_path), {"iter_num": step}, model, optimizers, sharded=True, lora=0)
        names = sorted(os.listdir(tmp_path))
        assert len(names) == 2 and names[0] == "ckpt" and re.fullmatch(r"ckpt\.old\.[0-9]+", names[1]), names
        assert ckpt.latest(str(tmp_path), True)[1] == step
    os.remove(tmp_path / names[1] / "held")  # the reader is done
    ckpt.save(str(tmp_path), {"iter_num": 4}, model, optimizers, sharded=True, lora=0)
    assert os.listdir(tmp_path) == ["ckpt"] and ckpt.latest(str(tmp_path), True)[1] == 4


def test_a_resume_with_a_smaller_keep_last_n_says_what_its_next_save_removes(data_dir, tmp_path):
    # the resume's first save removed two of three step copies, the only change of a resume not said
    from helpers import TINY, run
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=3", "--eval_interval=1",
        "--keep_last_n=3")
    assert len(list(tmp_path.glob("ckpt_0*.pt"))) == 3
    done = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--eval_interval=1",
               "--keep_last_n=1", "--init_from=resume")
    assert "note: keep_last_n=1, was 3: the next save keeps only the last 1 step copies (ckpt_NNNNNNN.pt) and " \
        "removes the older ones" in done.stdout, done.stdout
    assert [p.name for p in tmp_path.glob("ckpt_0*.pt")] == ["ckpt_0000004.pt"]


def test_keep_last_n_keeps_its_steps_whatever_their_file_times(tmp_path):
    # copies made with `cp` (no -p) dated in any order, or a clock stepped back: no step of the run goes
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    for step in (2, 4, 6):
        ckpt.save(str(tmp_path), {"iter_num": step}, model, optimizers, sharded=False, lora=0, keep_last_n=3)
    later = time.time() + 5
    for i, step in enumerate((6, 4, 2)):  # the lowest step copied last, the newest of all
        os.utime(tmp_path / f"ckpt_000000{step}.pt", (later + i, later + i))
    ckpt.save(str(tmp_path), {"iter_num": 8}, model, optimizers, sharded=False, lora=0, keep_last_n=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "ckpt_0000002.pt", "ckpt_0000004.pt", "ckpt_0000006.pt",
                                            "ckpt_0000008.pt"]


def test_a_resume_takes_each_processs_random_state_only_in_the_same_replicas():
    # two DDP replicas' dropout streams resumed as one tensor-parallel replica over the same two processes would
    # give its halves different dropout masks (and the weights both hold would drift apart): the seed's streams then
    saved = [{"cpu": torch.manual_seed(seed).get_state(), "cuda": None} for seed in (10, 11)]
    checkpoint = {"rng": saved, "config": {"tp_size": 1}}
    for tp_size, taken in ((1, True), (2, False)):
        torch.manual_seed(0)
        resume.resume_rng(checkpoint, 1, 2, tp_size, "cpu")
        assert torch.equal(torch.get_rng_state(), saved[1]["cpu"]) is taken
    # dropout's masks then differ from the run it continues, which the resume says (in this 1 process; without
    # dropout, the model's or its adapters', nothing)
    config = {"tp_size": 1, "dropout": 0.0, "eval_only": False}
    assert resume.dropout_note(checkpoint, {**config, "dropout": 0.1}, {}) == resume.dropout_note(
        checkpoint, config, {"lora_dropout": 0.05}) == [
        "note: dropout's masks are drawn from the seed again: the checkpoint's random streams are those of 2 "
        "process(es) (tp_size=1), not of these 1 (tp_size=1), and the run goes on otherwise than it would have"]
    assert resume.dropout_note(checkpoint, config, {}) == resume.dropout_note(
        checkpoint, {**config, "dropout": 0.1, "eval_only": True}, {}) == []


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_save_that_fails_making_its_copies_leaves_the_checkpoint_before_it(tmp_path, monkeypatch, sharded):
    # The disk fills (or the process dies) while the new best's copy is written: ckpt stays the step before, whose
    # resume saves the new step again, so ckpt_best never lags behind a ckpt that already counted it the best
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    out, suffix = str(tmp_path), "" if sharded else ".pt"
    ckpt.save(out, {"iter_num": 1}, model, optimizers, sharded=sharded, lora=0, improved=True)
    copy_file = ckpt.copy_file

    def full_disk(src, dst):
        if "ckpt_best" in dst:
            raise OSError(errno.ENOSPC, "No space left on device")
        copy_file(src, dst)
    monkeypatch.setattr(ckpt, "copy_file", full_disk)
    with pytest.raises(ckpt.UserError, match=f"could not write the checkpoint of step 2 .*/ckpt{suffix} from step 1 "
                                             f"is intact"):
        ckpt.save(out, {"iter_num": 2}, model, optimizers, sharded=sharded, lora=0, improved=True)
    assert sorted(os.listdir(tmp_path)) == [f"ckpt{suffix}", f"ckpt_best{suffix}"]
    assert ckpt.latest(out, sharded)[1] == 1 and resume.load_checkpoint(out + f"/ckpt_best{suffix}")["iter_num"] == 1
    monkeypatch.setattr(ckpt, "copy_file", copy_file)  # room again: the resumed run saves step 2, copies and all
    ckpt.save(out, {"iter_num": 2}, model, optimizers, sharded=sharded, lora=0, improved=True)
    assert [resume.load_checkpoint(out + f"/{name}{suffix}")["iter_num"] for name in ("ckpt", "ckpt_best")] == [2, 2]


def test_a_full_disk_at_the_start_says_make_room_and_leaves_out_dir_as_it_was(tmp_path, monkeypatch):
    # the lock's line (who holds it) is the first write of a run: a disk full then is not a folder to choose again
    (tmp_path / "ckpt.pt").write_bytes(b"a run's")
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(start.UserError, match=rf"^cannot write in out_dir={tmp_path} \(No space left on device\): "
                                              r"make room, and run it again \(what it holds is as it was\)$"):
        start.claim(str(tmp_path), True)
    assert (tmp_path / "ckpt.pt").read_bytes() == b"a run's"


def test_a_sharded_save_whose_shards_are_not_all_in_place_is_never_published(tmp_path, monkeypatch):
    # Another node's shards written to its own disk (out_dir not shared): here the one process's shard goes
    # missing after DCP wrote it, as rank 1's would be missing from rank 0's folder. The save stops in one line
    # and the checkpoint before it stays as it was.
    model = GPT(GPTConfig(**SHAPE))
    optimizers = [torch.optim.SGD(model.parameters(), lr=0.1)]
    ckpt.save(str(tmp_path), {"iter_num": 1}, model, optimizers, sharded=True, lora=0)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    dcp_save = ckpt.dcp().save

    def save_elsewhere(state, checkpoint_id):
        dcp_save(state, checkpoint_id=checkpoint_id)
        for shard in os.listdir(checkpoint_id):
            if shard.endswith(".distcp"):
                os.remove(os.path.join(checkpoint_id, shard))
    monkeypatch.setattr(ckpt.dcp(), "save", save_elsewhere)
    with pytest.raises(ckpt.UserError, match=r"ckpt.tmp lacks __0_0.distcp \(of 1 missing shard files\), written "
                                             r"where this node cannot see it: put out_dir on storage every node "
                                             r"shares; \S+/ckpt is left as it was"):
        ckpt.save(str(tmp_path), {"iter_num": 2}, model, optimizers, sharded=True, lora=0)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before and not (tmp_path / "ckpt.tmp").exists()
    assert torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)["iter_num"] == 1
    os.truncate(tmp_path / "ckpt" / "__0_0.distcp", 10)  # a published checkpoint's shard cut short: named to read
    with pytest.raises(ckpt.UserError, match=r"ckpt lacks its shard file __0_0.distcp \(of 1 missing or cut short\)"):
        resume.load_checkpoint(str(tmp_path / "ckpt"))


def test_a_full_disk_at_a_runs_start_checks_says_make_room_and_leaves_no_probe(tmp_path, monkeypatch):
    # check_room's and check_shared's probes (the lock's file had its room already, from a killed run): check_room said
    # "choose a folder this user can write to" and left its probe; check_shared ended every rank in a traceback
    import torch.distributed as dist
    from lib import files
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    said = rf"^cannot write in out_dir={tmp_path} \(No space left on device\): make room, and run it again"
    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", full)
        with pytest.raises(start.UserError, match=said):
            ckpt.check_room(str(tmp_path), 1000)
    real_open = open
    def full_open(path, *args, **kwargs):
        if os.path.basename(str(path)).startswith(".shared-"):
            real_open(path, *args, **kwargs).close()  # made, then the write fails
            full()
        return real_open(path, *args, **kwargs)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr("builtins.open", full_open)
        with pytest.raises(start.UserError, match=said):
            start.check_shared(str(tmp_path), True)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
    assert os.listdir(tmp_path) == []
    # a lock file the run cannot remove at its end (out_dir gone read-only) is left without a traceback
    fd = files.lock_folder(str(tmp_path), "train.py")
    def read_only(*args):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(os, "remove", read_only)
    files.unlock_folder(str(tmp_path), fd)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == [files.LOCK_NAME]  # left, and let go: the next run locks the folder
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(fd)
    files.unlock_folder(str(tmp_path), files.lock_folder(str(tmp_path), "train.py"))
    assert os.listdir(tmp_path) == []


def test_torchruns_line_for_a_worker_killed_by_a_signal_says_it_wrote_nothing():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from lib.launch import failed
    killed = ChildFailedError("train.py", {1: ProcessFailure(local_rank=1, pid=1, exitcode=-9, error_file=""),
                                           0: ProcessFailure(local_rank=0, pid=2, exitcode=1, error_file="")})
    assert failed(killed) == ("torchrun: train.py's rank 1 (and 1 more) ended by SIGKILL; killed from outside (the "
                              "kernel's out-of-memory killer, a kill -9), it wrote nothing: the other ranks' errors "
                              "above follow from its end")
    refused = ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=2, exitcode=1, error_file="")})
    assert failed(refused) == "torchrun: train.py's rank 0 ended with exit code 1; its own lines above say why"
    # NCCL's watchdog writes its line, then aborts
    aborted = ChildFailedError("train.py", {0: ProcessFailure(local_rank=0, pid=2, exitcode=-6, error_file="")})
    assert failed(aborted) == "torchrun: train.py's rank 0 ended by SIGABRT; its lines above, if any, say why"
