"""The learning rate schedule (optim.py), in process: each schedule's factor at chosen steps, the settings
refused, and the factor on every optimizer's own peak; one train.py run checks that the loop logs and applies it."""

import json
import math
import shutil

import pytest
import torch

from helpers import TINY, run, train_settings
from lib.files import UserError
from lib.optim import check_optimizer, lr_factor, run_steps, set_lr
from lib.resume import schedule_notes
from lib.settings import defaults, unused

# warmup over 2 steps, then from the peak down to min_lr / learning_rate = 0.1 at step 10 (lr_decay_iters)
SETTINGS = dict(warmup_iters=2, lr_decay_iters=10, learning_rate=1e-2, min_lr=1e-3, lr_decay_fraction=0.4,
                lr_cycle_iters=4, lr_power=2)
COSINE_QUARTER = 0.1 + 0.45 * (1 + math.cos(math.pi / 4))  # a quarter of the way down a cosine to 0.1
COSINE_THREE_QUARTERS = 0.1 + 0.45 * (1 + math.cos(3 * math.pi / 4))


@pytest.mark.parametrize("schedule,factors", [
    # warmup (s + 1) / 3 for s < 2, then from 1 down to 0.1 at step 10, and 0.1 after it
    ("cosine", {0: 1 / 3, 1: 2 / 3, 2: 1.0, 4: COSINE_QUARTER, 6: 0.55, 10: 0.1, 11: 0.1}),
    ("linear", {0: 1 / 3, 1: 2 / 3, 2: 1.0, 6: 0.55, 8: 0.325, 10: 0.1, 11: 0.1}),
    ("constant", {0: 1 / 3, 1: 2 / 3, 2: 1.0, 6: 1.0, 11: 1.0}),
    # wsd, decaying over the last 40% of lr_decay_iters: stable to step 6, then 0.9 lower over 4 steps
    ("wsd", {0: 1 / 3, 1: 2 / 3, 2: 1.0, 6: 1.0, 7: 0.775, 8: 0.55, 9: 0.325, 10: 0.1, 11: 0.1}),
    # polynomial of power 2: 0.1 + 0.9 (1 - (s - 2) / 8)^2
    ("polynomial", {0: 1 / 3, 2: 1.0, 4: 0.1 + 0.9 * 0.75**2, 6: 0.325, 9: 0.1 + 0.9 / 64, 10: 0.1, 11: 0.1}),
    # cosine restarts every 4 steps after warmup: down toward 0.1, back to the peak at step 6; 0.1 from step 10
    ("cosine_restarts", {0: 1 / 3, 2: 1.0, 3: COSINE_QUARTER, 4: 0.55, 6: 1.0, 7: COSINE_QUARTER,
                         9: COSINE_THREE_QUARTERS, 10: 0.1, 11: 0.1}),
])
def test_each_schedule_at_its_steps(schedule, factors):
    for step, factor in factors.items():
        assert lr_factor(step, lr_schedule=schedule, **SETTINGS) == pytest.approx(factor, rel=1e-12, abs=0), step


def test_no_decay_is_the_peak_throughout_and_a_zero_peak_has_a_zero_floor():
    assert all(lr_factor(step, decay_lr=False, **SETTINGS) == 1.0 for step in (0, 1, 5, 50))
    assert lr_factor(11, **{**SETTINGS, "learning_rate": 0.0}) == 0.0


@pytest.mark.parametrize("settings,message", [
    # names that can never become an optimizer or a schedule: the line names the setting and what it may be
    (dict(optimizer="no-such-optimizer"), "optimizer='no-such-optimizer' is not one of .*'adamw'"),
    (dict(lr_schedule="no-such-schedule"), "lr_schedule='no-such-schedule' is not one of .*'cosine'"),
    (dict(lr_cycle_iters=0), r"lr_cycle_iters=0 must be at least 1 and lr_power=1.0 above 0"),
    (dict(lr_power=0.0), r"lr_cycle_iters=1000 must be at least 1 and lr_power=0.0 above 0"),
    (dict(lr_power=math.inf), r"lr_power=inf above 0 and finite"),  # (a config file's: the rate at min_lr at once)
    (dict(lr_decay_fraction=1.5), r"lr_decay_fraction=1.5 must be between 0 and 1"),
])
def test_settings_no_schedule_can_use_are_refused(settings, message):
    with pytest.raises(UserError, match=message):
        check_optimizer({**defaults(), **settings})


def test_an_added_optimizers_setting_out_of_its_range_is_one_line_where_that_optimizer_is_used(monkeypatch):
    # an edit of lib/optim.py and lib/settings.py (docs/recipe.md): NAdam and its momentum_decay, which torch's
    # constructor refuses below 0. A run of another optimizer is not stopped by it (it is a setting out of play);
    # a run of NAdam is, in one line, where it was a traceback from torch
    from lib import optim, settings
    monkeypatch.setattr(settings, "nadam_momentum_decay", 4e-3, raising=False)
    monkeypatch.setitem(optim.OPTIMIZERS, "nadam", lambda named, config, fused: [torch.optim.NAdam(
        optim.groups(named, config), lr=config["learning_rate"], momentum_decay=config["nadam_momentum_decay"])])
    config = {**defaults(), "nadam_momentum_decay": -1.0}
    assert any("nadam_momentum_decay=-1.0 plays no part" in note for note in unused(config))  # adamw's run
    model = torch.nn.Linear(2, 2)
    assert len(optim.build_optimizers(model, config, "cpu")) == 1
    with pytest.raises(UserError, match=r"^optimizer='nadam' refuses its settings \(Invalid momentum_decay value: "
                                        r"-1.0\): set them within their range"):
        optim.build_optimizers(model, {**config, "optimizer": "nadam"}, "cpu")


@pytest.mark.slow
def test_a_schedule_added_with_a_knob_of_its_own_takes_it_from_the_command(data_dir, tmp_path):
    # the edit docs/configs.md names, in a copy of the project: an inverse square root schedule in lib/optim.py's
    # lr_factor, its timescale a new setting in lib/settings.py; nothing else edited, and the command's value is
    # the one that schedules the run (train.py passes every setting lr_factor takes)
    from helpers import ROOT, new_python
    edited = tmp_path / "edited"
    shutil.copytree(ROOT / "lib", edited / "lib", ignore=shutil.ignore_patterns("__pycache__"))
    for script in ROOT.glob("*.py"):
        shutil.copy(script, edited)
    optim = (edited / "lib" / "optim.py").read_text()
    for old, new in [('"cosine_restarts")', '"cosine_restarts", "rsqrt")'),
                     ("lr_power=1.0):", "lr_power=1.0, lr_timescale=100.0):"),
                     ('    if lr_schedule == "constant":',
                      '    if lr_schedule == "rsqrt":\n        return 1.0 / math.sqrt(1.0 + it / lr_timescale)\n'
                      '    if lr_schedule == "constant":')]:
        assert optim.count(old) == 1, old
        optim = optim.replace(old, new)
    (edited / "lib" / "optim.py").write_text(optim)
    with open(edited / "lib" / "settings.py", "a") as f:
        f.write("lr_timescale = 100.0  # rsqrt: the steps over which the rate falls as 1/sqrt(1 + step/timescale)\n")
    lrs = {}
    for timescale in (1, 100):
        out = tmp_path / f"t{timescale}"
        done = new_python("train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={out}", "--max_iters=4",
                          "--eval_interval=100", "--warmup_iters=0", "--lr_schedule=rsqrt",
                          f"--lr_timescale={timescale}", "--device=cpu", cwd=edited)
        assert done.returncode == 0, done.stderr[-2000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        lrs[timescale] = [r["lr"] for r in records if "tokens_per_s" in r]
    for timescale, logged in lrs.items():  # the rate of step s, logged after it
        assert logged == pytest.approx([1e-2 / math.sqrt(1 + s / timescale) for s in range(4)], rel=1e-6)
    # a resume with another value of it takes the command's, and says so, as of every setting of the schedule
    done = new_python("train.py", *TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path / 't1'}", "--max_iters=6",
                      "--eval_interval=100", "--warmup_iters=0", "--lr_schedule=rsqrt", "--lr_timescale=100",
                      "--init_from=resume", "--device=cpu", cwd=edited)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "the learning rate's schedule is this command's, not the checkpoint's (lr_timescale=100.0, was 1.0)" \
        in done.stdout, done.stdout


def test_every_optimizer_gets_the_factor_of_its_own_peak():
    weights = [torch.nn.Parameter(torch.zeros(2))]
    optimizers = [torch.optim.AdamW(weights, lr=1.0), torch.optim.SGD(weights, lr=1.0)]
    set_lr(optimizers, [1e-2, 0.05], 0.5)
    assert [opt.param_groups[0]["lr"] for opt in optimizers] == [1e-2 * 0.5, 0.05 * 0.5]
    # each group of an optimizer (the decayed matrices, the vectors that are not)
    groups = torch.optim.AdamW([{"params": weights}, {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=1.0)
    set_lr([groups], [1e-2], 0.25)
    assert [group["lr"] for group in groups.param_groups] == [1e-2 * 0.25] * 2


@pytest.mark.parametrize("settings", [dict(min_lr=1e-3), dict(min_lr=1e-2, decay_lr=False),
                                      dict(min_lr=1e-2, lr_schedule="constant")])
def test_a_floor_at_the_peak_or_one_no_schedule_reaches_is_taken(settings):
    check_optimizer({**defaults(), "learning_rate": 1e-3, **settings})  # (the floor above the peak is refused)


def test_the_loop_logs_and_applies_the_schedule(data_dir, tmp_path):
    # end to end: the rate logged for each step is the schedule's, and Muon's own peak is scaled by the same factor
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=12", "--eval_interval=100",
        "--warmup_iters=2", "--lr_decay_iters=10", "--learning_rate=1e-2", "--min_lr=1e-3", "--optimizer=muon",
        "--muon_lr=0.05", "--lr_schedule=wsd", "--lr_decay_fraction=0.4")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["iter"] - 1: r["lr"] for r in records if "tokens_per_s" in r}  # the step's rate, logged after it
    assert sorted(lrs) == list(range(12))
    for step, lr in lrs.items():
        assert lr == 1e-2 * lr_factor(step, lr_schedule="wsd", **{**SETTINGS, "lr_decay_fraction": 0.4}), step
    muon = torch.load(tmp_path / "ckpt.pt", weights_only=True)["more_optimizers"][0]
    assert muon["param_groups"][0]["lr"] == pytest.approx(0.05 * 0.1, rel=1e-9)


def test_a_run_that_max_iters_ends_before_max_epochs_says_its_schedule_outlasts_it(data_dir, tmp_path):
    # 100 epochs would take far more than 4 steps. The schedule keeps its length (max_iters is also how a run is
    # stopped to be resumed, on the same schedule: test_train's mid-epoch resume), and the log says so, with the fix
    done = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=4", "--max_epochs=100",
               "--eval_interval=100", "--warmup_iters=0", "--lr_decay_iters=1000", "--learning_rate=1e-2",
               "--min_lr=1e-3")
    assert "max_epochs=100: 4 steps (lr_decay_iters 1000, warmup 0)" in done.stdout
    assert ("note: max_iters=4 ends the run before its 100 epochs, and the learning rate decays over "
            "lr_decay_iters=1000 steps: it will not reach min_lr in this run (for a run of 4 steps, set "
            "lr_decay_iters=4)") in done.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["iter"] - 1: r["lr"] for r in records if "tokens_per_s" in r}
    assert lrs[3] > 0.99e-2  # as the note says: barely decayed
    # with the fix it names, the last step's rate is three quarters of the way down the cosine to min_lr: the run's
    # steps as train.py sets them (optim.run_steps, epochs of 10**6 steps), then the schedule the loop applies
    max_iters, decay_iters, warmup_iters, note = run_steps(4, 4, 0, max_epochs=100, epoch_steps=10**6)
    assert (max_iters, decay_iters, warmup_iters) == (4, 4, 0) and "note: max_iters" not in note
    last = 1e-2 * lr_factor(3, warmup_iters=0, lr_decay_iters=decay_iters, learning_rate=1e-2, min_lr=1e-3)
    assert last == pytest.approx(1e-2 * COSINE_THREE_QUARTERS, rel=1e-9) and last < 0.25e-2


def test_the_runs_steps_under_max_epochs_and_warmup_ratio():
    # optim.run_steps, as train.py calls it once the epochs' steps are known
    assert run_steps(100, 90, 5) == (100, 90, 5, "")
    assert run_steps(100, 90, 5, warmup_ratio=0.1) == (100, 90, 10, "")  # of max_iters, rounded up
    # a warmup past where wsd's decay would begin: it begins after the warmup, shorter, and says so
    assert run_steps(20, 20, 10, lr_schedule="wsd", lr_decay_fraction=0.6)[3] == (
        "note: warmup_iters=10 reaches into wsd's decay, the last lr_decay_fraction=0.6 of lr_decay_iters=20 steps: "
        "it decays over the 10 steps after the warmup (lower warmup_iters or lr_decay_fraction)")
    wsd = dict(lr_schedule="wsd", warmup_iters=10, lr_decay_iters=20, lr_decay_fraction=0.6, min_lr=0.0)
    assert [lr_factor(it, **wsd) for it in (10, 15)] == [1.0, 0.5]
    assert run_steps(20, 20, 8, lr_schedule="wsd", lr_decay_fraction=0.6)[3] == ""  # the decay's 12 steps whole
    assert run_steps(10, 10, 2, lr_schedule="wsd", lr_decay_fraction=0.8)[3] == ""  # (10 x 0.2 is not 2 in floats)
    # max_epochs ends the run first, and the decay with it; warmup_ratio counts those steps
    assert run_steps(100, 90, 5, 0.25, max_epochs=2, epoch_steps=30) == \
        (30, 30, 8, "max_epochs=2: 30 steps (lr_decay_iters 30, warmup 8)")
    # resumed inside that warmup (more epochs made it longer, or a stop came in it), the line says so
    assert run_steps(100, 90, 5, 0.25, max_epochs=2, epoch_steps=30, step=7)[3] == \
        "max_epochs=2: 30 steps (lr_decay_iters 30, warmup 8: from step 7, where the run goes on, the learning " \
        "rate is in it)"
    assert run_steps(100, 90, 5, 0.25, max_epochs=2, epoch_steps=30, step=8)[3].endswith("warmup 8)")
    # max_iters ends it first: the schedule keeps lr_decay_iters, and the note says so with the fix
    steps = run_steps(10, 90, 5, max_epochs=2, epoch_steps=30)
    assert steps[:3] == (10, 30, 5) and "set lr_decay_iters=10" in steps[3]
    # and warmup_ratio the epochs' steps, as the whole run's: its first part, resumed, goes on on the same schedule
    assert run_steps(10, 90, 5, 0.25, max_epochs=2, epoch_steps=30)[:3] == (10, 30, 8)
    # a run shortened with its schedule left as it was: the decay (a schedule that decays), or even the warmup, is
    # cut short, and the note says so with the fix
    assert run_steps(10, 90, 5)[3] == ("note: max_iters=10 ends the run, and the learning rate decays over "
                                       "lr_decay_iters=90 steps: it will not reach min_lr in this run (for a run of "
                                       "10 steps, set lr_decay_iters=10)")
    assert run_steps(10, 90, 5, lr_schedule="constant")[3] == run_steps(10, 90, 5, decay_lr=False)[3] == ""
    # under warmup_ratio, which sets warmup_iters, the note names it (lowering warmup_iters would change nothing)
    assert run_steps(3, 100, 1, warmup_ratio=0.5, max_epochs=1, epoch_steps=16)[3].endswith(
        "note: warmup_ratio=0.5 (a warmup of 8) is not below max_iters=3: the run ends in its warmup, short of the "
        "peak learning rate (lower warmup_ratio)")
    assert run_steps(10, 10, 10)[3] == ("note: warmup_iters=10 is not below max_iters=10: the run ends in its warmup, "
                                        "short of the peak learning rate (lower warmup_iters)")
    # a decay that ends before the warmup does: the warmup, then min_lr at once
    assert run_steps(20, 3, 5)[3] == ("note: lr_decay_iters=3 is not past warmup_iters=5: the learning rate falls "
                                      "from its warmup straight to min_lr, with no decay (raise lr_decay_iters)")
    assert run_steps(20, 3, 5, lr_schedule="constant")[3] == run_steps(20, 3, 5, decay_lr=False)[3] == ""
    assert "lr_decay_iters=0 is not past warmup_iters=0: the learning rate falls" in run_steps(20, 0, 0)[3]
    assert run_steps(0, 90, 5)[3] == run_steps(0, 0, 0)[3] == ""  # a run of no steps: no schedule to speak of


def test_a_resume_takes_the_commands_optimizer_settings_and_says_so(data_dir, tmp_path):
    # the checkpoint's param_groups would otherwise bring back the weight decay and betas it was saved with
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2"]
    run(*args, "--max_iters=2")
    same = run(*args, "--max_iters=4", "--init_from=resume")
    assert "note: the optimizer's" not in same.stdout  # the same command: nothing changed
    out = run(*args, "--max_iters=6", "--init_from=resume", "--weight_decay=0.0", "--beta2=0.9")
    assert "note: the optimizer's betas, weight_decay are this command's, not the checkpoint's" in out.stdout
    groups = torch.load(tmp_path / "ckpt.pt", weights_only=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0] and all(tuple(g["betas"]) == (0.9, 0.9) for g in groups)


@pytest.mark.slow  # eleven train.py runs: ~40 s
def test_a_resume_that_changes_the_schedule_but_not_max_iters_says_so(data_dir, tmp_path):
    # the run's end stays, but the rates from the checkpoint's step on are not those of the run it continues
    args = [*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--eval_interval=2", "--max_iters=6",
            "--keep_last_n=3"]
    run(*args)
    shutil.copy(tmp_path / "ckpt_0000004.pt", tmp_path / "ckpt.pt")  # gone back to step 4
    same = run(*args, "--init_from=resume").stdout  # the same command
    assert "the learning rate's schedule" not in same and "the checkpoint's, from step" not in same
    shutil.copy(tmp_path / "ckpt_0000004.pt", tmp_path / "ckpt.pt")
    out = run(*args, "--init_from=resume", "--lr_decay_iters=10", "--learning_rate=2e-2")
    assert ("note: the learning rate's schedule is this command's, not the checkpoint's (lr_decay_iters=10, was 20; "
            "learning_rate=0.02, was 0.01): from step 4 on the run differs from the one it continues") in out.stdout
    shutil.copy(tmp_path / "ckpt_0000004.pt", tmp_path / "ckpt.pt")  # dropout and clipping are the command's too
    out = run(*args, "--init_from=resume", "--dropout=0.1", "--grad_clip=0.5", "--dtype=float32")
    assert "note: dropout=0.1, was 0.0; grad_clip=0.5, was 1.0: this command's, not the checkpoint's, from step 4 on" \
        in out.stdout
    # dtype='auto' as this machine makes it: a checkpoint of another's (bfloat16 on a GPU) is said to differ
    run(*args, "--dtype=bfloat16", "--max_iters=4", f"--out_dir={tmp_path / 'bf16'}")
    out = run(*args, f"--out_dir={tmp_path / 'bf16'}", "--init_from=resume")
    assert "note: dtype=float32, was bfloat16: this command's, not the checkpoint's, from step 4 on" in out.stdout
    # under warmup_ratio, a longer run's warmup is longer: one that ends past the step takes the rates back into it
    run(*args, "--warmup_ratio=0.5", "--max_iters=4", f"--out_dir={tmp_path / 'ratio'}")
    out = run(*args, "--warmup_ratio=0.5", "--max_iters=12", f"--out_dir={tmp_path / 'ratio'}", "--init_from=resume")
    assert ("; warmup_ratio=0.5 makes the warmup 6 steps (was 2): from step 4 the learning rate is back in it"
            in out.stdout), out.stdout
    # the checkpoint's own warmup (its ratio of its max_iters), and no "back" for a run still in it
    out = run(*args, "--warmup_ratio=0.25", "--max_iters=40", f"--out_dir={tmp_path / 'ratio'}", "--init_from=resume")
    assert "; warmup_ratio=0.25 makes the warmup 10 steps (was 6)" in out.stdout and "back in it" not in out.stdout
    # under max_epochs the epochs' steps set it (more epochs, a longer warmup): the steps' line says where the run is
    run(*args, "--warmup_ratio=0.5", "--max_epochs=1", "--max_iters=4", f"--out_dir={tmp_path / 'epochs'}")
    out = run(*args, "--warmup_ratio=0.5", "--max_epochs=2", "--max_iters=8", f"--out_dir={tmp_path / 'epochs'}",
              "--init_from=resume")
    assert ": from step 4, where the run goes on, the learning rate is in it)" in out.stdout, out.stdout
    # the same batches split otherwise: dropout's masks, drawn a micro-step at a time, are not the run's it continues
    run(*args, "--dropout=0.1", "--max_iters=4", f"--out_dir={tmp_path / 'drop'}")
    out = run(*args, "--dropout=0.1", f"--out_dir={tmp_path / 'drop'}", "--init_from=resume", "--batch_size=2",
              "--gradient_accumulation_steps=2")
    assert ("note: an update's sequences are split 2 x 2, not as the checkpoint's: the same batches, but dropout "
            "draws its masks a micro-step at a time") in out.stdout and "warning: seed" not in out.stdout
    # batch_size='auto' split it as a checkpoint's: no note where the command gives that split, and a note where
    # 'auto' splits a checkpoint's otherwise (its 2 x 2: here the 4 sequences fit in one micro-step)
    auto = [*args, "--dropout=0.1", "--memory_budget=8.0"]  # (the worker running it may hold a GiB already)
    run(*auto, "--batch_size=auto", "--max_iters=4", f"--out_dir={tmp_path / 'auto'}")
    out = run(*auto, f"--out_dir={tmp_path / 'auto'}", "--init_from=resume", "--batch_size=4").stdout
    assert "an update's sequences are split" not in out
    run(*auto, "--batch_size=2", "--gradient_accumulation_steps=2", "--max_iters=4", f"--out_dir={tmp_path / 'two'}")
    shutil.copytree(tmp_path / "two", tmp_path / "seeded")
    out = run(*auto, "--batch_size=2", "--gradient_accumulation_steps=2", "--batch_size=auto", "--init_from=resume",
              f"--out_dir={tmp_path / 'two'}").stdout
    assert "batch_size='auto': micro-batch 4 of 4 sequences" in out
    assert "note: an update's sequences are split 4 x 1, not as the checkpoint's" in out
    out = run(*auto, "--batch_size=2", "--gradient_accumulation_steps=2", "--batch_size=auto", "--init_from=resume",
              "--seed=7", f"--out_dir={tmp_path / 'seeded'}").stdout  # other batches: said, and no note of the same
    assert "warning: seed, sequences, block_size" in out and "an update's sequences are split" not in out


def test_a_resume_behind_the_end_its_max_epochs_set_trains_nothing_and_says_that_alone():
    # a run saved at step 981 of its 2 epochs, resumed for 1 epoch (491 steps) under a larger max_iters: the epochs
    # end it before the step, and the notes said it ended at 1000 with a schedule differing from step 981 on
    before = {**defaults(), "max_iters": 100000, "lr_decay_iters": 100000, "max_epochs": 2}
    config = {**before, "max_iters": 1000, "max_epochs": 1}
    assert schedule_notes(before, config, 981, 491) == [
        "note: max_epochs=1 is behind the checkpoint's step 981 (it ends the run at step 491): nothing is trained "
        "(raise max_epochs to train on)"]
    assert schedule_notes(before, {**config, "max_iters": 900}, 981, 491)[0].startswith("note: max_epochs=1 is behind")
    assert schedule_notes(before, {**config, "max_iters": 900}, 981, 900) == [
        "note: max_iters=900 is behind the checkpoint's step 981: nothing is trained (raise max_iters to train on)"]
    # epochs that end past the step: the end's move and the schedule's are said, as before
    notes = schedule_notes(before, config, 981, 1000)
    assert notes[0].startswith("note: max_iters is 1000, not the checkpoint's 100000: the run ends at step 1000 (or "
                               "at the 1 epochs' last, if sooner)") and "(max_epochs=1, was 2)" in notes[1]


def test_a_setting_its_other_settings_leave_out_of_play_is_noted(data_dir, tmp_path):
    # config/train_small.py's wsd decay fraction, once a flag picks another schedule, and settings given beside
    # what they belong to: each says so at the start, and a setting left at its default says nothing
    config = train_settings(["config/train_small.py", "--lr_schedule=cosine", "--eval_stride=8"])
    assert unused(config) == [
        "note: lr_decay_fraction=0.4 plays no part in this run: it is a setting of lr_schedule='wsd', and the run's "
        "is lr_schedule='cosine'",
        "note: eval_stride=8 plays no part in this run: it is a setting of eval_full=True, and the run's is "
        "eval_full=False"]
    # batch_size_auto, as a user says it
    assert unused(train_settings(["--memory_budget=4.0"])) == [
        "note: memory_budget=4.0 plays no part in this run: it is a setting of batch_size='auto', and the run's is "
        "batch_size=12"]
    assert unused(train_settings(["config/train_small.py"])) == unused(train_settings([])) == []
    # eval_only: one evaluation, whatever a training config says of training (one note, not one a setting)
    assert unused(train_settings(["config/train_small.py", "--eval_only=True"])) == [
        "note: eval_only=True evaluates once and exits, writing nothing: the settings of training, checkpoints and "
        "logging play no part"]
    assert unused(train_settings(["--eval_tasks_limit=5", "--eval_tasks_path=tasks"])) == [  # with no eval_tasks
        f"note: {name} plays no part in this run: it is a setting of eval_tasks, and the run's is eval_tasks=''"
        for name in ("eval_tasks_limit=5", "eval_tasks_path='tasks'")]
    assert unused(train_settings(["--eval_tasks=mine", "--eval_tasks_limit=5"])) == []
    # another optimizer's own settings, found from what each optimizer reads; Muon's AdamW reads the betas
    assert unused(train_settings(["--optimizer=sgd", "--beta1=0.8", "--momentum=0.5"])) == [
        "note: beta1=0.8 plays no part in this run: optimizer='sgd' does not read it"]
    assert unused(train_settings(["--optimizer=muon", "--beta2=0.9", "--muon_lr=0.01"])) == []
    assert unused(train_settings(["--muon_lr=0.01", "--momentum=0.5"])) == [
        "note: momentum=0.5 plays no part in this run: optimizer='adamw' does not read it",
        "note: muon_lr=0.01 plays no part in this run: optimizer='adamw' does not read it"]
    out = run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=1", "--decay_lr=False")
    assert "note: warmup_iters=2 plays no part in this run: it is a setting of decay_lr=True" in out.stdout
    # and the schedule's other settings: the learning rate is learning_rate throughout
    assert [note.split(" plays")[0] for note in unused(train_settings(
        ["--decay_lr=False", "--warmup_ratio=0.5", "--min_lr=1e-5", "--lr_decay_iters=90"]))] == [
        "note: warmup_ratio=0.5", "note: lr_decay_iters=90", "note: min_lr=1e-05"]
    # what examples do anyway (val is scored example by example), and a logger's names
    assert [note.split(" plays")[0] for note in unused(train_settings(
        ["--sequences=examples", "--doc_mask=True", "--eval_full=True", "--eval_stride=8", "--wandb_project=p"]))] == [
        "note: eval_stride=8", "note: eval_full=True", "note: wandb_project='p'"]
    assert unused(train_settings(["--sequences=random", "--doc_mask=True", "--eval_full=True", "--eval_stride=8",
                                  "--wandb_log=True", "--wandb_run_name=r"])) == []
    # a schedule's own knob too (train_small.py's wsd fraction), as its schedule is out of play
    assert unused(train_settings(["config/train_small.py", "--decay_lr=False"]))[-1] == (
        "note: lr_decay_fraction=0.4 plays no part in this run: it is a setting of decay_lr=True, and the run's is "
        "decay_lr=False")


def test_a_schedule_setting_its_schedule_leaves_out_of_play_is_noted():
    # warmup_ratio above 0 replaces warmup_iters, and 'constant' holds the peak: no decay to min_lr at lr_decay_iters
    assert unused(train_settings(["--warmup_ratio=0.1", "--warmup_iters=10"])) == [
        "note: warmup_iters=10 plays no part in this run: it is a setting of warmup_ratio=0.0, and the run's is "
        "warmup_ratio=0.1"]
    assert [note.split(" plays")[0] for note in unused(train_settings(
        ["--lr_schedule=constant", "--min_lr=1e-5", "--lr_decay_iters=90"]))] == [
        "note: lr_decay_iters=90", "note: min_lr=1e-05"]
    assert unused(train_settings(["--lr_schedule=linear", "--min_lr=1e-5", "--warmup_iters=10"])) == []
