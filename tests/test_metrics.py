"""The run's clock (metrics.py): the time left from the steps' and evaluations' times, its format, and train.py's
log lines giving it, the finish time and the wall time."""

import errno
import json
import math
import os
import re
import sys
import time

import pytest

from helpers import TINY, run
from lib.metrics import (RECENT_STEPS, WARMUP_STEPS, duration, evaluations_left, finish_time, open_log, seconds_left,
                         start_clock, time_left)


def test_a_val_loss_past_a_floats_range_has_an_infinite_perplexity(capsys):
    # (it had been e^50, printed as a number)
    from lib.metrics import report_evaluation
    logged = []
    report_evaluation(logged.append, True, 10, {"train": 1.0, "val": 800.0, "train_accuracy": 0.0, "val_accuracy": 0.0},
                      {}, 0.5, 1e-3)
    assert "val loss 800.0000, val perplexity inf" in capsys.readouterr().out and logged[0]["val_ppl"] == math.inf


def test_the_time_a_step_takes_leaves_out_the_pauses(monkeypatch):
    from lib import metrics
    now = [100.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])
    speed = metrics.Speedometer()
    for _ in range(4):
        speed.step(keys=16)
    speed.pause(2.0)  # an evaluation
    now[0] += 10.0
    assert speed.seconds_per_step() == 2.0 and speed.keys == 64


def test_an_evaluation_is_printed_and_logged_under_its_own_names(capsys):
    from lib.metrics import report_evaluation
    logged = []
    losses = {"train": 1.5, "val": 2.0, "train_accuracy": 0.2, "val_accuracy": 0.7}
    report_evaluation(logged.append, True, 10, losses, {"task/acc": 0.25}, 0.5, 1e-3)
    assert logged == [{"iter": 10, "loss": 1.5, "val_loss": 2.0, "val_ppl": math.exp(2.0), "accuracy": 0.2,
                       "val_accuracy": 0.7, "lr": 1e-3, "epoch": 0.5, "task/acc": 0.25}]
    assert capsys.readouterr().out == ("step 10: train loss 1.5000, val loss 2.0000, val perplexity 7.39, val accuracy "
                                       "70.0%, epoch 0.50\nstep 10: task/acc 0.2500\n")


def test_mfu_counts_every_query_against_block_size_keys_and_the_keys_it_met():
    from lib.metrics import utilization
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16))
    mfu, mfu_run, note = utilization(model, 32, 16.5, 1000.0, 1e9)
    assert (mfu, mfu_run) == (model.flops_per_token(32) * 1000 / 1e9, model.flops_per_token(32, 16.5) * 1000 / 1e9)
    assert mfu > mfu_run and note == f"{mfu:.1%} PaLM, {mfu_run:.1%} run"
    assert utilization(model, 32, 16.5, 1000.0, None) == (None, None, "n/a")


def test_evaluations_left_counts_every_interval_and_the_end():
    # the evaluation of the step reached is still to come: the loop evaluates a step before it updates it
    assert evaluations_left(20, 100, 50) == 2  # 50, 100
    assert evaluations_left(50, 100, 50) == 2  # 50 itself, 100
    assert evaluations_left(51, 100, 50) == 1
    assert evaluations_left(20, 110, 50) == 3  # 50, 100, and the end at 110
    assert evaluations_left(101, 110, 50) == 1  # the end alone
    assert evaluations_left(110, 110, 50) == 1
    assert evaluations_left(1, 1, 250) == 1


def test_seconds_left_from_step_and_evaluation_times():
    intervals = [(10, 2.0), (10, 3.0)]  # 20 steps in 5 s: 0.25 s a step
    assert seconds_left(intervals, 4.0, 20, 100, 50) == pytest.approx(80 * 0.25 + 2 * 4.0)
    assert seconds_left(intervals, 4.0, 20, 110, 50) == pytest.approx(90 * 0.25 + 3 * 4.0)
    assert seconds_left(intervals, None, 20, 100, 50) == pytest.approx(80 * 0.25)  # no evaluation timed yet
    assert seconds_left(intervals, 4.0, 100, 100, 50) == pytest.approx(4.0)  # the last evaluation only


def test_time_left_skips_the_warm_up_and_follows_the_recent_steps():
    clock = start_clock()
    # log_interval=1: the first WARMUP_STEPS steps give no estimate, however slow they were
    for step in range(1, WARMUP_STEPS + 1):
        assert time_left(clock, step, 1000, 100, 60.0, 1) == (None, "")
    clock["eval_seconds"] = 10.0
    left, note = time_left(clock, WARMUP_STEPS + 1, 1000, 100, 0.5, 1)
    assert left == pytest.approx((1000 - WARMUP_STEPS - 1) * 0.5 + 10 * 10.0)  # evaluations at 100, ..., 1000
    assert re.fullmatch(r", \d+m\d\ds left, ends ~(\d{4}-\d\d-\d\d )?\d\d:\d\d", note), note

    # log_interval=10: the first interval is the warm-up; then the mean over the latest RECENT_STEPS steps
    clock, step = start_clock(), 10
    assert time_left(clock, step, 1000, 1000, 100.0, 10) == (None, "")
    clock["eval_seconds"] = 0.0
    per_step = [1.0] * (RECENT_STEPS // 10) + [2.0] * (RECENT_STEPS // 10)
    notes = []
    for seconds in per_step:
        step += 10
        left, note = time_left(clock, step, 1000, 1000, seconds, 10)
        notes.append(note)
    assert left == pytest.approx((1000 - step) * 2.0)  # the 1 s steps have left the window
    step += 10
    left, _ = time_left(clock, step, 1000, 1000, 4.0, 10)
    assert left == pytest.approx((1000 - step) * (4 * 2.0 + 4.0) / 5)
    # the finish time on the first lines with an estimate, then the time left alone
    assert all(", ends ~" in note for note in notes[:3]) and not any(", ends ~" in note for note in notes[3:])
    assert all(" left" in note for note in notes)
    # intervals of unequal steps: an older one stays until the later ones hold RECENT_STEPS steps by themselves
    clock = {**start_clock(), "steps": WARMUP_STEPS, "eval_seconds": 0.0}
    time_left(clock, 1000, 10**6, 10**6, 1.0, RECENT_STEPS)
    left, _ = time_left(clock, 1010, 10**6, 10**6, 3.0, 10)
    assert left == pytest.approx((10**6 - 1010) * (RECENT_STEPS * 1.0 + 10 * 3.0) / (RECENT_STEPS + 10))


def test_time_left_says_when_no_evaluation_was_timed():
    clock = start_clock()
    for step in range(1, WARMUP_STEPS + 2):
        left, note = time_left(clock, step, 10, 5, 1.0, 1)
    assert left == pytest.approx(10 - WARMUP_STEPS - 1)
    assert note.startswith(f", {10 - WARMUP_STEPS - 1}s left (evaluations not timed yet), ends ~")


def test_a_run_without_end_gives_the_time_left_and_no_finish_time():
    # max_iters=sys.maxsize (training until an early stop): the time left of ~2.9e12 years, and no date past the
    # platform's clock (time.localtime raised OverflowError at the run's first estimate)
    clock = start_clock()
    for step in range(1, WARMUP_STEPS + 2):
        left, note = time_left(clock, step, sys.maxsize, 1000, 10.0, 1)
    assert left == pytest.approx(10.0 * sys.maxsize, rel=1e-6) and note.endswith("h left (evaluations not timed yet)")


def test_duration_reads_as_a_person_would():
    assert [duration(s) for s in (0, 45.4, 59.6, 725, 3599.6, 7380, 86399, 86400, 86400 + 4 * 3600 + 59)] == \
        ["0s", "45s", "1m00s", "12m05s", "1h00m", "2h03m", "23h59m", "1d00h", "1d04h"]


def test_finish_time_on_the_local_clock():
    now = time.mktime((2026, 11, 26, 14, 0, 0, 0, 0, -1))  # 14:00 local time
    assert finish_time(32 * 60 + 5, now) == "14:32"
    assert finish_time(11 * 3600, now) == "2026-11-27 01:00"  # another day: with its date
    assert finish_time(3 * 86400, now) == "2026-11-29 14:00"


def test_log_lines_give_the_time_left_and_the_last_line_the_wall_time(data_dir, tmp_path):
    common = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=4"]
    out = run(*common, "--max_iters=8").stdout  # TINY logs every step
    lines = {int(m[1]): m[0] for m in re.finditer(r"^iter (\d+): .*$", out, re.MULTILINE)}
    assert sorted(lines) == list(range(1, 9))
    assert not any(" left" in lines[i] for i in range(1, WARMUP_STEPS + 1))  # the warm-up
    assert all(re.search(r"MB, [0-9dhms]+ left", lines[i]) for i in range(WARMUP_STEPS + 1, 9))
    assert [i for i in lines if re.search(r"left, ends ~\d\d:\d\d$", lines[i])] == [4, 5, 6]  # the first three
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"run ended at step 8: wall time [0-9dhms]+ since train.py started", last)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    left = {r["iter"]: r["time_left_s"] for r in records if "tokens_per_s" in r}
    assert [left[i] for i in range(1, WARMUP_STEPS + 1)] == [None] * WARMUP_STEPS
    assert left[8] > 0  # the last evaluation and its checkpoint are still to come

    # a resume measures its own process: the warm-up again, and no evaluation timed before step 12's
    out = run(*common, "--max_iters=12", "--init_from=resume").stdout
    assert "iter 11:" in out and " left" not in out.split("iter 12:")[0]
    assert re.search(r"^iter 12: .*MB, 0s left \(evaluations not timed yet\), ends ~", out, re.MULTILINE)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["time_left_s"] for r in records if "tokens_per_s" in r][-1] == 0.0  # no steps, evaluation untimed
    assert out.strip().splitlines()[-1].startswith("run ended at step 12: wall time ")


def test_a_record_cut_by_a_kill_goes_before_the_resumed_run_writes(tmp_path):
    # a process killed in the middle of a write leaves an unfinished line: the next process's records start a line
    from lib.metrics import open_log
    whole = json.dumps({"iter": 10, "loss": 2.5}) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"iter": 20, "loss": 2.1, "lr": 0.000')
    log, close = open_log(str(tmp_path), {}, master=True)
    log({"iter": 20, "loss": 2.0})
    close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == whole.strip() and [json.loads(line)["loss"] for line in lines] == [2.5, 2.0]
    # a file of whole records is left as it is, and no file is made before the first record
    open_log(str(tmp_path), {}, master=True)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines
    open_log(str(tmp_path / "new"), {}, master=True)
    assert not (tmp_path / "new" / "metrics.jsonl").exists()
    # one unfinished record alone: nothing of it is kept
    (tmp_path / "metrics.jsonl").write_text('{"iter": 1, "lo')
    open_log(str(tmp_path), {}, master=True)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resumed_runs_clock_goes_on_from_its_last_kept_record(tmp_path):
    # elapsed_s is the run's wall time (plot.py's): a resume's records go on from the last one it keeps, where its
    # first record may come later than the last one before (it would have been taken for the first process's time)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iter": step, "elapsed_s": 10.0 * step}) + "\n" for step in (10, 20, 30)))
    log, close = open_log(str(tmp_path), {}, master=True, step=20)
    log({"iter": 30, "loss": 1.0})
    close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iter"] for r in records] == [10, 20, 30] and 200.0 <= records[-1]["elapsed_s"] < 260  # (+ this test's)
    log, close = open_log(str(tmp_path), {}, master=True, step=0)  # from scratch: from 0
    log({"iter": 10, "loss": 1.0})
    close()
    assert json.loads(path.read_text())["elapsed_s"] < 60


def test_a_resume_drops_what_a_process_recorded_past_its_checkpoint(tmp_path):
    # resumed at step 20 (an earlier checkpoint, or one before a kill -9): the records of steps past 20 are gone
    # from metrics.jsonl and from TensorBoard, before the run records them again; a run from scratch keeps none.
    # TensorBoard's events are read as its default (fast) loader reads them, which reads no purge_step: every
    # event of every file (its old loader drew the dead process's steps 30 and 40 no more, the fast one did)
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
    from tensorboard.compat.proto.event_pb2 import Event
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=0)
    for step in (10, 20, 21, 30, 40):  # (21: the first step a resume at 20 trains)
        log({"iter": step, "loss": float(step)})
    close()
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=20)
    log({"iter": 30, "loss": 3.0})
    close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["iter"], r["loss"]) for r in records] == [(10, 10.0), (20, 20.0), (30, 3.0)]

    def scalars():
        events = [Event.FromString(raw) for path in sorted((tmp_path / "tb").iterdir())
                  for raw in RawEventFileLoader(str(path)).Load()]
        return sorted((e.step, v.simple_value) for e in events for v in e.summary.value if v.tag == "loss")
    assert scalars() == [(10, 10.0), (20, 20.0), (30, 3.0)]
    # a resume with nothing past its step (a SIGTERM's save) goes on in the events there, as where metrics.jsonl is
    # gone: TensorBoard's may be the only record of the run, and is kept (a rewrite took it all away)
    (tmp_path / "metrics.jsonl").unlink()
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=30)
    log({"iter": 40, "loss": 4.0})
    close()
    assert scalars() == [(10, 10.0), (20, 20.0), (30, 3.0), (40, 4.0)]
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=0)
    log({"iter": 10, "loss": 1.0})
    close()
    assert scalars() == [(10, 1.0)]
    # a resume without TensorBoard that cuts records past its step takes the events that no longer match away; the
    # next start with it writes them anew, as for a run that turns TensorBoard on late (it got none of them before)
    log, close = open_log(str(tmp_path), {}, master=True, step=10)
    log({"iter": 20, "loss": 2.0})
    close()
    log, close = open_log(str(tmp_path), {}, master=True, step=10)
    assert scalars() == []
    log({"iter": 20, "loss": 2.5})
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=20)
    log({"iter": 30, "loss": 3.0})
    close()
    assert scalars() == [(10, 1.0), (20, 2.5), (30, 3.0)]
    # a resume without TensorBoard that cuts nothing: the events miss its records, and the next start with it
    # writes them all anew (it had gone on after the checkpoint's step, its events without step 40)
    log, close = open_log(str(tmp_path), {}, master=True, step=30)
    log({"iter": 40, "loss": 4.0})
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=40)
    log({"iter": 50, "loss": 5.0})
    close()
    assert scalars() == [(10, 1.0), (20, 2.5), (30, 3.0), (40, 4.0), (50, 5.0)]


def test_a_tensorboard_folder_that_cannot_be_made_is_a_warning_and_the_run_goes_on(tmp_path, capsys):
    (tmp_path / "tb").write_text("a file where the folder goes")
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=0)
    log({"iter": 1, "loss": 1.0})
    close()
    assert capsys.readouterr().out.startswith(f"warning: cannot write {tmp_path}/tb (")
    assert [json.loads(line)["iter"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_tensorboard_on_a_full_disk_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    # TensorBoard's writer thread meets a full disk, which its next add_scalar raises: said once, as metrics.jsonl's
    # failures are, and the records go on to metrics.jsonl (it ended the run in a traceback)
    from torch.utils.tensorboard import SummaryWriter

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    log, close = open_log(str(tmp_path), {}, master=True, tensorboard_log=True, step=0)
    log({"iter": 1, "loss": 1.0})
    monkeypatch.setattr(SummaryWriter, "add_scalar", full)
    monkeypatch.setattr(SummaryWriter, "close", full)
    for step in (2, 3):
        log({"iter": step, "loss": float(step)})
    close()
    assert capsys.readouterr().out == (f"warning: cannot write {tmp_path}/tb (No space left on device); training goes "
                                       f"on without TensorBoard\n")
    assert [json.loads(line)["iter"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_record_the_disk_had_room_for_only_in_part_leaves_no_piece(tmp_path, monkeypatch):
    # A full disk takes part of a record: the piece goes, so that the records written once there is room again each
    # begin their own line (else plot.py, and any reader, refuses the whole file)
    log, _ = open_log(str(tmp_path), {}, True)
    log({"iter": 1, "loss": 1.0})
    write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: write(fd, data[:10]))
    log({"iter": 2, "loss": 2.0})
    monkeypatch.setattr(os, "write", write)
    log({"iter": 3, "loss": 3.0})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iter"] for line in lines] == [1, 3]
