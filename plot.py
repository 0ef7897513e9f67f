"""
A run's curves as a picture: train and val loss against steps and against wall time, with the learning rate and
tokens/s beside them, from the run's metrics.jsonl. Several runs are drawn together, a color each, to compare.

    python plot.py out-small                                   # -> out-small/curves.png
    python plot.py out-small out-wide --to=compare.png --title="4 vs 8 layers"

Needs matplotlib (pip install matplotlib: requirements.txt leaves it out). Wall time is each record's elapsed_s,
the run's, which a resume goes on from (in a log whose clock starts again at a resume, the restarts are joined end
to end); a run of a version without it is drawn against steps only.
"""

import argparse
import json
import math
import os

from lib.files import UserError, one_line_errors, replaced_whole


def read_run(out_dir):
    """A run's records -> (steps, evaluations): the logged training steps (skipped updates left out) and the
    evaluations, each a list of records by step, with "wall_s" added where the records have time."""
    path = os.path.join(out_dir, "metrics.jsonl")
    fix = "name a run's out_dir (train.py writes it there)"
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path} ({getattr(e, 'strerror', None) or 'not UTF-8 text'}): {fix}") from None
    records = []
    for number, line in enumerate(lines[:-1], 1):  # the last, without its newline, is a record being written
        try:
            record = json.loads(line) if line.strip() else {"iter": 0}
            if not isinstance(record, dict) or not isinstance(record.get("iter"), (int, float)):
                raise ValueError("not a record with its step, iter")
            numbers = ("loss", "val_loss", "lr", "tokens_per_s", "elapsed_s")
            record.update({k: math.nan for k in numbers if k in record and record[k] is None})  # non-finite: a gap
            bad = [k for k in numbers if k in record and type(record[k]) not in (int, float)]
            if bad:
                raise ValueError(f"{', '.join(bad)} not a number")
        except ValueError as e:
            raise UserError(f"{path} is not one JSON record a line ({getattr(e, 'msg', e)} at line {number}): "
                            f"{fix}") from None
        records += [record] if line.strip() else []
    offset, last = 0.0, 0.0
    for record in records:  # a resumed run's process starts its clock again: its times follow the last one's
        if "elapsed_s" in record:
            if record["elapsed_s"] < last:
                offset += last
            last = record["elapsed_s"]
            record["wall_s"] = offset + last
    # a resumed run logs again the steps after its checkpoint: a step's last record is the one that counts
    evaluations = sorted({r["iter"]: r for r in records if "val_loss" in r}.values(), key=lambda r: r["iter"])
    trained = [r for r in records if "val_loss" not in r and not r.get("skipped") and "loss" in r]
    steps = sorted({r["iter"]: r for r in trained}.values(), key=lambda r: r["iter"])
    if not steps and not evaluations:
        raise UserError(f"{path} holds no step or evaluation yet: plot it after the first log line")
    return steps, evaluations


def draw(runs, title):
    # runs: [(label, steps, evaluations)] -> a matplotlib figure of four panels
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    figure, ((by_step, by_time), (lr, speed)) = plt.subplots(2, 2, figsize=(12, 8))
    for i, (label, steps, evaluations) in enumerate(runs):
        color = f"C{i}"
        for axes, x in ((by_step, "iter"), (by_time, "wall_s")):
            train = [r for r in steps if x in r]
            axes.plot([r[x] for r in train], [r["loss"] for r in train], color=color, alpha=0.5, lw=1,
                      marker="." if len(train) == 1 else None, label=f"{label} train")  # (a line of one: unseen)
            val = [r for r in evaluations if x in r]
            axes.plot([r[x] for r in val], [r["val_loss"] for r in val], "o-", color=color, ms=4, label=f"{label} val")
        for axes, key in ((lr, "lr"), (speed, "tokens_per_s")):
            logged = [r for r in steps if key in r]
            axes.plot([r["iter"] for r in logged], [r[key] for r in logged], color=color, label=label,
                      marker="." if len(logged) == 1 else None)
    for axes, xlabel, ylabel in ((by_step, "step", "loss"), (by_time, "wall time (s)", "loss"),
                                 (lr, "step", "learning rate"), (speed, "step", "tokens/s")):
        axes.set(xlabel=xlabel, ylabel=ylabel)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def labels(out_dirs):
    # each run's name: its folder's, or as many of its path's last folders as tell it from the others' (a/out, b/out)
    parts, names = [os.path.abspath(d).split(os.sep) for d in out_dirs], []
    for i, path in enumerate(parts):
        for k in range(1, len(path) + 1):
            if all(other[-k:] != path[-k:] for j, other in enumerate(parts) if j != i):
                break
        names.append(os.sep.join(path[-k:]))
    return names


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dirs", nargs="+", help="runs' folders, each with its metrics.jsonl")
    parser.add_argument("--to", default=None, help="the PNG to write (default: curves.png in the first run's folder)")
    parser.add_argument("--title", default=None, help="the figure's title (default: the runs' folders)")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401 (found out now, not after reading every run)
    except ImportError:
        raise UserError("plot.py draws with matplotlib: pip install matplotlib") from None
    runs = [(label, *read_run(d)) for label, d in zip(labels(args.out_dirs), args.out_dirs)]
    to = args.to or os.path.join(args.out_dirs[0], "curves.png")
    if not to.lower().endswith(".png"):
        raise UserError(f"--to={to}: plot.py writes a PNG; name it NAME.png")
    figure = draw(runs, args.title or ", ".join(label for label, _, _ in runs))
    with replaced_whole(to, "wb") as f:  # a link planted at curves.png is replaced, never written through
        figure.savefig(f, dpi=100, format="png")
    print(f"wrote {to}")


if __name__ == "__main__":
    one_line_errors("plot.py")
    main()
