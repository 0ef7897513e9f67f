"""plot.py: a run's metrics.jsonl (one run or several) -> a PNG of its curves; a resumed run's clock joined end to
end; a folder without records refused in one line."""

import json
import math
import struct

import pytest

from helpers import TINY, run, script

pytest.importorskip("matplotlib")


def png_size(path):
    # (width, height) from a PNG's header, after checking it is one
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    return struct.unpack(">II", data[16:24])


def test_two_runs_drawn_together_and_one_by_default_into_its_folder(data_dir, tmp_path):
    for name, layers in (("two", 2), ("three", 3)):
        run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / name}", f"--n_layer={layers}",
            "--max_iters=6", "--eval_interval=3")
    done = script("plot.py", tmp_path / "two", tmp_path / "three", f"--to={tmp_path / 'both.png'}")
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr
    assert png_size(tmp_path / "both.png") == (1200, 800)
    # by default into the first run's folder, where a link planted at curves.png is replaced, not written through
    (tmp_path / "victim.txt").write_text("precious")
    (tmp_path / "two" / "curves.png").symlink_to(tmp_path / "victim.txt")
    assert script("plot.py", tmp_path / "two").returncode == 0
    assert png_size(tmp_path / "two" / "curves.png") == (1200, 800) and not (tmp_path / "two" / "curves.png").is_symlink()
    assert (tmp_path / "victim.txt").read_text() == "precious"


def test_runs_of_one_folder_name_are_told_apart_and_a_single_record_is_seen():
    from plot import draw, labels
    assert labels(["lab/a/out", "lab/b/out/", "/runs/wide"]) == ["a/out", "b/out", "wide"]
    assert labels(["out-small"]) == ["out-small"]
    figure = draw([("one", [{"iter": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 9.0, "wall_s": 1.0}], [])], "one")
    assert all(line.get_marker() == "." for axes in figure.axes for line in axes.lines if len(line.get_xdata()) == 1)
    assert sum(len(axes.lines) for axes in figure.axes) == 6  # train by step and by time, their empty val, lr, speed


def test_a_resumed_runs_clock_continues_and_an_empty_run_is_refused(tmp_path):
    from plot import read_run
    records = [{"iter": 10, "loss": 3.0, "lr": 1e-3, "elapsed_s": 5.0},
               {"iter": 10, "loss": 3.0, "val_loss": 3.1, "elapsed_s": 6.0},
               {"iter": 20, "loss": 2.0, "lr": 1e-3, "elapsed_s": 2.0},  # the resumed process: its clock anew
               {"iter": 21, "loss": None, "skipped": True, "elapsed_s": 2.5},  # a NaN, in JSON
               {"iter": 22, "loss": None, "val_loss": None, "elapsed_s": 2.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps, evaluations = read_run(tmp_path)
    assert [r["wall_s"] for r in steps] == [5.0, 8.0] and [r["wall_s"] for r in evaluations] == [6.0, 8.6]
    assert math.isnan(evaluations[-1]["val_loss"])  # drawn as a gap
    # the steps a killed run had logged past its checkpoint, logged again by its resume: the last records count
    killed = [{"iter": i, "loss": 5.0 - i, "lr": 1e-3} for i in (1, 2, 3, 4)] + [{"iter": 2, "val_loss": 3.6}]
    records = killed + [{"iter": i, "loss": 9.0 - i, "lr": 2e-3} for i in (3, 4, 5)] + [{"iter": 2, "val_loss": 3.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps, evaluations = read_run(tmp_path)
    assert [(r["iter"], r["loss"]) for r in steps] == [(1, 4.0), (2, 3.0), (3, 6.0), (4, 5.0), (5, 4.0)]
    assert [r["val_loss"] for r in evaluations] == [3.5]
    # a resume that logs at other steps than the killed run did: by step all the same
    records = [{"iter": i, "loss": 1.0, "lr": 1e-3} for i in (10, 20, 30, 15, 20, 25, 30, 35)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [r["iter"] for r in read_run(tmp_path)[0]] == [10, 15, 20, 25, 30, 35]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    done = script("plot.py", tmp_path / "empty")
    assert done.returncode == 1 and "holds no step or evaluation yet" in done.stderr
    done = script("plot.py", tmp_path / "nowhere")
    assert done.returncode == 1 and "cannot read" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_record_being_written_is_left_out_and_a_bad_line_is_named(tmp_path):
    # the last line without its newline is a record train.py is writing (or a killed one left, which its resume
    # cuts off): read without it; a bad line before the last is refused, named by its number in the file
    from plot import read_run
    records = "".join(json.dumps({"iter": i, "loss": 3.0 - i, "lr": 1e-3}) + "\n" for i in (1, 2, 3))
    (tmp_path / "metrics.jsonl").write_text(records + '{"iter": 4, "loss": 4.7')
    assert [r["iter"] for r in read_run(tmp_path)[0]] == [1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text(records + '{"iter": 4, "loss": 4.7\n' + records)
    done = script("plot.py", tmp_path)
    assert done.returncode == 1 and "not one JSON record a line" in done.stderr and "at line 4)" in done.stderr
    # what is no record of ours, and a picture that cannot be written, are one line too (tracebacks before)
    for text, says in ((bytes(range(128, 256)) + b"\n", "not UTF-8 text"), (b"1\n", "not a record with its step"),
                       (b'"val_loss"\n', "not a record with its step"), (b'{"loss": 1}\n', "not a record"),
                       (b'{"iter": 1, "loss": 1, "elapsed_s": "x"}\n', "elapsed_s not a number at line 1"),
                       (b'{"iter": 1, "val_loss": "3.1"}\n', "val_loss not a number")):
        (tmp_path / "metrics.jsonl").write_bytes(text)
        done = script("plot.py", tmp_path)
        assert done.returncode == 1 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1
    (tmp_path / "metrics.jsonl").write_text(records)
    for to, says in ((tmp_path / "curves", "plot.py writes a PNG; name it NAME.png"),
                     (tmp_path / "nowhere" / "a.png", "cannot write")):
        done = script("plot.py", tmp_path, f"--to={to}")
        assert done.returncode == 1 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_full_disk_leaves_the_earlier_picture_as_it_was(tmp_path, monkeypatch):
    # the disk fills part way through the new PNG: one line, and the earlier curves.png whole, nothing else left
    import sys
    import matplotlib.figure
    import plot
    from lib.files import UserError
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"iter": i, "loss": 3.0 - i}) + "\n" for i in (1, 2)))
    monkeypatch.setattr(sys, "argv", ["plot.py", str(tmp_path)])
    plot.main()
    before = (tmp_path / "curves.png").read_bytes()

    def full_disk(figure, f, **kwargs):
        f.write(before[:1000])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    with pytest.raises(UserError, match=rf"^cannot write {tmp_path / 'curves.png'} \(No space left on device\); what "
                                        rf"was there is as it was: make room, or write elsewhere$"):
        plot.main()
    assert (tmp_path / "curves.png").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]
