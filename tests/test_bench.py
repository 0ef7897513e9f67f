"""bench.py --mode=gpu, everything a GPU must show, in sections that run alone at tiny shapes on CPU (--tiny):
each writes its Markdown file as it goes, holds numbers, and leaves no checkpoint behind; a section stopped
early keeps the rows it finished; docs/measuring.md's groups of sections fit their minutes. Timings are a CPU's and are
not checked. And bench.py --mode=encode, prepare.py's throughput against tiktoken's."""

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CPU_ENV, TINY, needs_tiktoken, new_python, run, script
from lib.resume import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["versus", "race", "kernels", "step", "memory", "optimizers", "finetune", "tests"]
NANOGPT = ROOT.parent / "shared" / "anchors" / "nanogpt"  # this team's unchanged nanoGPT, where there is one
RACE_SECONDS = 0.01  # --section=race: each side's training time, one step at any speed (nanoGPT's shortest run)


def rows(text):
    # a Markdown file's table rows, as lists of cells (headers and rules left out)
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    headers = {line for line in lines if line.startswith(("| op |", "| run |", "| model |", "| optimizer |",
                                                          "| fine-tune |", "| tier |"))}
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines if line not in headers]


def number(cell):
    return re.fullmatch(r"-?[\d,]+(\.\d+)?%?", cell) is not None


def run_section(section, tmp_path, *extra, stop_at=None):
    # bench.py --mode=gpu --tiny --section=SECTION --out=tmp_path/out, a new Python in a session of its own, its
    # file read every 0.1 s while it runs: (return code, the file's contents as seen while it ran, the log).
    # stop_at: a pattern at which it is killed with every process it started, as a call at the GPU machine's limit is
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    cmd = ["bench.py", "--mode=gpu", "--tiny", f"--section={section}", f"--out={out}", "--steps=3", "--warmup=1",
           *extra]
    # the kernels under Triton's interpreter would take minutes: their references stand in on CPU
    proc = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, env={**os.environ, **CPU_ENV, "TRITON_INTERPRET": "0",
                            "TMPDIR": str(tmp)}, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    seen, path, give_up = [], out / f"{section}.md", time.time() + 600
    try:
        while proc.poll() is None and time.time() < give_up:
            text = path.read_text() if path.exists() else ""
            if text and (not seen or seen[-1] != text):
                seen.append(text)
            if stop_at and re.search(stop_at, text):
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
    return proc.returncode, seen, log


def check_versus(text, out):
    runs = {r[0]: r for r in rows(text)}
    assert runs.keys() == {"nanoGPT's train.py", "ours, defaults", "ours, --use_kernels=False",
                           "ours, --use_kernels=True", "nanoGPT's model", "our model, defaults"}
    assert runs["nanoGPT's train.py"][3] == "1.00x" and all(map(number, runs["ours, defaults"][1:3]))
    assert all(number(runs[name][1]) and runs[name][3].startswith("versus-profile-") for name in
               ("nanoGPT's model", "our model, defaults"))
    for side in ("nanogpt", "ours"):  # torch.profiler's table, the ops by time
        profile = (out / f"versus-profile-{side}.txt").read_text()
        assert "Name" in profile and ("aten::mm" in profile or "aten::addmm" in profile), profile
    assert "number of parameters" not in text  # nanoGPT's own prints are not lines of the report


def check_race(text):
    assert "on real text" in text and "gradient_accumulation_steps=4" in text
    race = {r[0]: r for r in rows(text)}
    assert race.keys() == {"nanoGPT", "ours"}
    for ms, steps, seconds, loss in (map(float, r[1:]) for r in race.values()):
        # as many steps as the time holds at the speed measured first; the whole val split's loss, from the final
        # weights, below a uniform guess over GPT-2's vocabulary (ln 50,257 = 10.83) and finite
        assert steps == max(1, round(RACE_SECONDS * 1000 / ms)) and abs(seconds - steps * ms / 1000) < 0.1
        assert 0 < loss < 10.83


def check_kernels(text):
    kernels = rows(text)
    assert {r[0] for r in kernels} == {"rms_norm", "swiglu", "apply_rotary", "linear_cross_entropy"}
    assert all(number(r[3]) and number(r[5]) for r in kernels)  # eager and fused ms (compiled: GPU only)


def check_step(text):
    steps = {r[0]: r for r in rows(text)}
    assert {"kernels off, eager", "kernels on, eager"} <= steps.keys()
    assert any("doc_mask" in name for name in steps)
    assert all(len(r) == 7 and all(map(number, r[1:])) for r in steps.values())


def check_memory(text):
    assert "eager: --compile=False" in text
    measured = [r for r in rows(text) if not r[2].startswith("failed")]
    assert [r[1] for r in measured] == ["one process", "checkpointing"]
    assert all(map(number, measured[0][2:4] + measured[0][5:])) and measured[0][4].startswith("n/a")  # (the CPU's)
    assert "fsdp_cpu_offload=True" in text  # CUDA only: a line


def check_optimizers(text):
    # learnable text: with random ids no model gets below the uniform loss, ln(512) for bpe:512
    assert "standard library" in text
    optimizers = {r[0]: r for r in rows(text)}
    assert optimizers.keys() == {"adamw", "muon"} and all(map(number, optimizers["muon"][1:]))
    assert all(float(r[1]) < math.log(512) - 0.3 for r in optimizers.values()), optimizers


def check_finetune(text):
    assert "10 steps" in text
    text, beside = text.split("Against transformers + peft")
    # ours against transformers + peft on the same folder and tokens, full and LoRA: both speeds numbers, their ratio
    against = {r[0]: r for r in rows(beside)}
    assert against.keys() == {"full", "LoRA"}
    for _, speed, theirs, ratio, *_ in against.values():
        assert number(speed) and number(theirs) and ratio.endswith("x")
        ours, other = (float(cell.replace(",", "")) for cell in (speed, theirs))
        assert abs(float(ratio[:-1]) - ours / other) <= 0.01  # printed rounded
    finetunes = {r[0]: r for r in rows(text)}
    assert finetunes.keys() == {"full", "LoRA", "LoRA, int8 base", "QLoRA"}
    assert all(len(finetunes[name]) == 6 and all(map(number, finetunes[name][2:])) for name in ("full", "LoRA"))


def check_tests(text):
    tiers = {r[0].split(" (")[0]: r for r in rows(text)}
    assert tiers.keys() == {"CUDA tier", "quick tier, on the CPU"}
    assert re.search(r"^\d+ passed", tiers["quick tier, on the CPU"][1])  # tests/test_readme.py stands in
    assert "commit feedbee" in text


@pytest.mark.slow
@pytest.mark.parametrize("section", SECTIONS)
def test_each_section_alone_writes_its_file_as_it_goes(section, tmp_path):
    extra = ["--commit=feedbee"] if section == "tests" else []
    if section == "versus":
        if not (NANOGPT / "train.py").is_file():
            pytest.skip(f"--section=versus runs nanoGPT's own train.py, and there is no nanoGPT checkout at {NANOGPT}")
        extra = [f"--nanogpt={NANOGPT}", "--steps=4"]
    if section == "race":
        if not (NANOGPT / "train.py").is_file() or "TIKTOKEN_CACHE_DIR" not in os.environ:
            pytest.skip("--section=race runs nanoGPT's own train.py on text in GPT-2 tokens: no nanoGPT checkout at "
                        f"{NANOGPT}, or no tiktoken cache")
        extra = [f"--nanogpt={NANOGPT}", "--steps=3", f"--seconds={RACE_SECONDS}"]
    if section == "finetune":  # a train.py setting given once, that bench.py sets for its runs: its own win (the
        extra = ["--log_interval=50"]  # user's had, leaving no logged tokens/s over 10 steps: a traceback)
    if section == "optimizers":  # enough steps, at rates a tiny model learns at, to leave the uniform loss
        extra = ["--steps=15", "--learning_rate=1e-2", "--muon_lr=0.05"]
    returncode, seen, log = run_section(section, tmp_path, *extra)
    assert returncode == 0, log[-3000:]
    text = (tmp_path / "out" / f"{section}.md").read_text()
    assert re.match(rf"## \d{{4}}-\d\d-\d\d, GPU: CPU.*--section={section}\)", text)
    assert re.search(r"torch \S+, Triton \S+, CUDA \S+, commit \w+", text)
    assert re.search(rf"\n\({section}: [\d.]+ minutes\)\n", text)
    # the file held its header before the section ended: written as it went, not at the end (seen by polling, so
    # only where the section takes seconds: the kernels' at tiny shapes can take less than one poll; the file they
    # are written to is the same, and a section killed part way keeps its rows: the test below)
    if section != "kernels":
        assert any("\n### " in s and "minutes)" not in s for s in seen[:-1]), seen
    globals()[f"check_{section}"](*([text, tmp_path / "out"] if section == "versus" else [text]))
    # nothing is left behind: no checkpoint, no scratch folder
    left = [p for p in (tmp_path / "tmp").rglob("*") if p.name.startswith(("ckpt", "bench-gpu"))]
    assert left == []


@pytest.mark.slow
@pytest.mark.kills
def test_a_section_stopped_early_keeps_the_rows_it_finished(tmp_path):
    # killed (with the train.py under way) once its first row is written, as at the end of a call's time
    returncode, seen, _ = run_section("memory", tmp_path, stop_at=r"\| tiny \| one process \| [\d,]+ \|.*\|\n")
    assert returncode == -signal.SIGKILL
    text = (tmp_path / "out" / "memory.md").read_text()
    assert text.startswith("## ") and "### Memory estimate" in text and "minutes)" not in text
    assert [r[1] for r in rows(text)] == ["one process"]


def test_a_section_name_not_known_is_refused_in_one_line(tmp_path):
    # in this process (helpers.script): a new Python would spend seconds importing torch
    done = script("bench.py", "--mode=gpu", "--tiny", "--section=kernels,speed")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0
    assert "--section=kernels,speed: choose among versus, race, kernels, step" in done.stderr


def test_readme_gpu_groups_fit_their_minutes():
    # the budget in docs/measuring.md (linked from the README), a row a section, each in one of its groups of
    # sections: a group takes at most 8 minutes on an H100, so that the default --minutes (6.5) leaves its last row
    # time to finish
    page = (ROOT / "docs" / "measuring.md").read_text()
    table = page[page.index("## Measuring on a GPU"):].split("\n\n| section | group |")[1].split("\n\n")[0]
    budget = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]
    assert sorted(row[0].strip("`") for row in budget) == sorted(SECTIONS)
    groups = {}
    for row in budget:
        groups[row[1]] = groups.get(row[1], 0) + float(row[-1])
    assert max(groups.values()) <= 8, groups


@pytest.mark.slow  # six prepare.py runs, new Pythons each
@needs_tiktoken
def test_encode_mode_reports_prepare_against_tiktoken_on_the_same_texts(tmp_path):
    # what prepare.py --bench was: prepare.py's run against tiktoken's batch encoder, on the documents it encoded;
    # a tokenizer that is not tiktoken's is refused in one line
    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document {i}: " + f"the quick brown fox {i} jumps over the lazy dog. " * 2000 for i in range(3)]
    for i, text in enumerate(texts):
        (src / f"doc{i}.txt").write_text(text)
    # bench.py in this process (helpers.script), run from another folder; the prepare.py runs it times are new Pythons
    cmd = ["bench.py", "--mode=encode", src, "--num_workers=2"]
    done = script(*cmd, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    head = re.search(r"bench: ([\d.]+) MB in (\d+) documents, gpt2, 2 threads, best of 5", done.stdout)
    assert head and head[2] == "3" and float(head[1]) == round(sum(map(len, texts)) / 1e6, 1), done.stdout
    ratio = re.search(r"ratio: ([\d.]+) of tiktoken's throughput", done.stdout)
    assert ratio and 0.1 < float(ratio[1]) < 10, done.stdout
    done = script(*cmd, "--tokenizer=char")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0
    assert "bench.py: --mode=encode compares against tiktoken" in done.stderr



@pytest.mark.slow  # nanoGPT's train.py and two of ours, new Pythons each (~1 minute on 2 cores)
def test_seeds_mode_puts_our_seeds_beside_nanogpts_run_on_the_whole_val_split(data_dir, tmp_path):
    if not (NANOGPT / "train.py").is_file():
        pytest.skip(f"--mode=seeds runs nanoGPT's own train.py, and there is no nanoGPT checkout at {NANOGPT}")
    # the tests' characters with the vocabulary nanoGPT reads, its meta.pkl, as nanoGPT's prepare.py leaves one (its
    # train.py reads only vocab_size; without the file it models GPT-2's 50,304 tokens, ~3x the time here)
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    vocab_size = json.loads((data / "meta.json").read_text())["vocab_size"]
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": vocab_size}))
    data_dir = data
    done = script("bench.py", "config/train_shakespeare_char_cpu.py", "--mode=seeds", "--tiny",
                  f"--nanogpt={NANOGPT}", f"--data_dir={data_dir}", "--threads=1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = [r for r in rows(done.stdout) if r[0] in ("nanoGPT", "ours")]
    # each side at seeds 1 and 2 (nanoGPT's fixed seed moved by the wrapper), which give other models
    assert [(r[0], r[1]) for r in runs] == [("nanoGPT", "1"), ("nanoGPT", "2"), ("ours", "1"), ("ours", "2")]
    assert all(number(r[2]) and number(r[3]) and number(r[4]) for r in runs)
    theirs, ours = [float(r[4]) for r in runs[:2]], [float(r[4]) for r in runs[2:]]
    assert theirs[0] != theirs[1] and ours[0] != ours[1] and all(math.isfinite(loss) for loss in theirs)
    assert all(loss < math.log(64) for loss in ours)  # learned past uniform over 62 characters (nanoGPT's 20
    # steps, in its warmup at its lower rate, need not)
    assert re.search(rf"{len(open(data_dir / 'val.bin', 'rb').read()) // 2:,} val tokens", done.stdout)
    assert re.search(r"ours, worst seed [\d.]+ against nanoGPT's mean [\d.]+: (not )?below it; nanoGPT's mean wall "
                     r"time / ours: [\d.]+x \(CPU time: [\d.]+x\)", done.stdout)
    done = script("bench.py", "--mode=seeds", "--tiny")
    assert done.returncode == 1 and "--nanogpt=DIR" in done.stderr and done.stderr.strip().count("\n") == 0


def test_seeds_mode_refuses_our_dataset_of_another_vocabulary_without_nanogpts_meta_pkl(data_dir, tmp_path):
    # nanoGPT, without meta.pkl, models GPT-2's 50,304 tokens: its losses would not be comparable with ours
    (tmp_path / "nanogpt").mkdir()
    (tmp_path / "nanogpt" / "train.py").write_text("")  # (refused before it runs)
    done = script("bench.py", "--mode=seeds", "--tiny", f"--nanogpt={tmp_path / 'nanogpt'}", f"--data_dir={data_dir}")
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "has no meta.pkl, without which nanoGPT trains on GPT-2's vocabulary" in done.stderr


def test_same_runs_refuses_what_it_cannot_compare_before_it_makes_anything(tmp_path):
    # (a traceback had come after its data was made, its temporary folder left behind)
    done = new_python("tools/same_runs.py", tmp_path, "--only=plain", env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 1 and done.stderr.strip() == f"{tmp_path} is no checkout of the trainer (no train.py " \
        f"there): make one with git worktree add /tmp/before REVISION"
    done = new_python("tools/same_runs.py", ROOT, "--only=plain,bogus", env={"TMPDIR": str(tmp_path)})
    assert done.returncode == 1 and done.stderr.startswith("no run named bogus: the runs are plain, ")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow  # three new Pythons, each importing torch
def test_load_mode_measures_its_three_loads_at_a_tiny_shape():
    # each load in a Python of its own, which imports the project's load_pretrained: a table of three rows, the
    # streamed load's memory above the baseline's
    done = script("bench.py", "--mode=load", "--tiny")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [row.split(" | ")[0] for row in rows] == ["| baseline (import torch, torch._dynamo and model.py)",
                                                    "| load_pretrained (streamed)", "| file read whole, then a model"]
    assert all(float(row.split(" | ")[1].replace(",", "")) > 0 for row in rows)


def test_train_py_settings_pass_through_whole_not_as_abbreviations_of_benchs_own(monkeypatch):
    # --seed is train.py's: argparse would take it for an abbreviation of bench.py's --seeds
    import bench
    monkeypatch.setattr(sys, "argv", ["bench.py", "config/train_small.py", "--seed=42", "--steps=12"])
    args, train_args = bench.parse_args()
    assert args.seeds is None and args.steps == 12 and train_args == ["config/train_small.py", "--seed=42"]


def test_what_a_copied_train_py_command_sets_that_bench_py_sets_itself_is_said(monkeypatch, capsys):
    # taken, as a train.py command copied whole runs; the table's header named them as if they had been run
    import bench
    monkeypatch.setattr(sys, "argv", ["bench.py", "--eval_interval=2", "--log_interval=3", "--dropout=0.1"])
    assert bench.parse_args()[1] == ["--eval_interval=2", "--log_interval=3", "--dropout=0.1"]
    assert capsys.readouterr().out == ("note: --eval_interval, --log_interval: bench.py's own, in place of this "
                                       "command's (one evaluation, at the end)\n")


@pytest.mark.parametrize("argv, says", [
    (["--seconds=nan"], "--seconds=nan above 0 and finite"),  # (a race's steps from it: a traceback after a run)
    (["--mode=race", "--seconds=inf"], "--seconds=inf above 0 and finite"),
    # what bench.py sets itself, after the user's: the run had gone on without them, the header still naming them
    (["--max_iters=100"], "--max_iters: bench.py sets it, running --steps steps"),
    (["--compare=max_iters", "--values=5,10"], "--max_iters: bench.py sets it"),
    (["--mode=race", "--run=--out_dir=mine --compile=False"], "--out_dir: bench.py sets it"),
    (["--compare=eval_iters", "--values=1,50"], "--eval_iters: bench.py sets it"),
    (["--mode=race", "--run=--lr_decay_iters=100"], "--lr_decay_iters: bench.py sets it"),
    (["--compare=log_interval", "--values=1,5"], "--log_interval: bench.py sets it"),
])
def test_what_bench_py_cannot_run_or_would_override_is_refused_before_any_run(monkeypatch, argv, says):
    import bench
    from lib.files import UserError
    monkeypatch.setattr(sys, "argv", ["bench.py", *argv])
    with pytest.raises(UserError, match=re.escape(says)):
        bench.parse_args()


@pytest.mark.parametrize("setting, says", [("--dtype=bogus", "dtype='bogus' is not one of"),
                                           ("--n_layer=0", "says n_layer=0, not a whole number above 0"),
                                           ("--rope_theta=0.0", "says rope_theta=0.0, not a number in its range")])
def test_memory_mode_refuses_the_settings_train_py_refuses(setting, says):
    # (a table was printed for a model no run can build, or a traceback for the dtype)
    done = script("bench.py", "--mode=memory", setting)
    assert done.returncode == 1 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_memory_mode_plans_a_resume_with_its_checkpoints_shape(data_dir, tmp_path):
    # (it had planned the settings' default 30M model for any --init_from=resume)
    from benchmarks.measure import planned_model
    run(*TINY, f"--data_dir={data_dir}", f"--out_dir={tmp_path}", "--max_iters=2", "--n_layer=3")
    _, model, _ = planned_model([f"--out_dir={tmp_path}", "--init_from=resume", f"--data_dir={data_dir}"])
    assert (model.config.n_layer, model.config.n_embd, model.config.n_kv_head) == (3, 32, 2)
    weights = load_checkpoint(str(tmp_path / "ckpt.pt"))["model"]
    assert {name: t.shape for name, t in model.state_dict().items()} == {name: t.shape for name, t in weights.items()}
    _, model, _ = planned_model([f"--out_dir={tmp_path / 'none'}", "--init_from=auto", f"--data_dir={data_dir}"])
    assert model.config.n_layer == 6  # no checkpoint there: the settings' own (the default shape)


def test_memory_mode_lists_only_layouts_train_py_runs():
    # Muon refuses fsdp=True and tensor parallel (lib/optim.check_optimizer): --mode=memory estimates no FSDP
    # or TP layout for it, as it leaves out none for AdamW
    from benchmarks.measure import planned_model
    from benchmarks.modes import memory_layouts
    for optimizer, sharded in (("muon", False), ("adamw", True)):
        g, model, _ = planned_model(["config/train_gpt2.py", f"--optimizer={optimizer}"])
        layouts = [layout for _, layout in memory_layouts(g, model.config)]
        assert any(layout.get("fsdp") or layout.get("tp") for layout in layouts) == sharded, (optimizer, layouts)
        assert {} in layouts  # one process runs either


def test_memory_section_estimates_the_settings_it_measures(tmp_path, monkeypatch, capsys):
    # bench.py's other --key=value go to every train.py it runs: the estimate beside each measured peak is of the
    # same settings (here a wider MLP, which TINY does not set), not of the section's shape alone
    import types
    from benchmarks import gpu
    monkeypatch.setattr(gpu, "throughput", lambda *a, **k: ({"tokens_per_s": 1.0}, 1.0))  # no train.py run
    estimates = []
    for train_args in ([], ["--mlp_hidden=4096"]):
        gpu.section_memory(False, str(tmp_path), types.SimpleNamespace(steps=3, warmup=1), train_args)
        row = next(r for r in rows(capsys.readouterr().out) if r[:2] == ["tiny", "one process"])
        estimates.append(float(row[2].replace(",", "")))
        assert row[4].startswith("n/a")  # a CPU's peak is the whole process's: no ratio to a tensors' estimate
    assert estimates[1] > estimates[0], estimates


def test_versus_profiles_hold_one_model_at_a_time(tmp_path, monkeypatch):
    # each side's profiled step (and the CUDA peak measured there) holds its own model and optimizer state alone,
    # not the other side's too; a stand-in for nanoGPT's model.py, that no checkout is needed
    import gc
    import torch
    from benchmarks import gpu
    (tmp_path / "model.py").write_text(
        "import torch\n"
        "class GPTConfig:\n    def __init__(self, **kw): self.__dict__.update(kw)\n"
        "class GPT(torch.nn.Module):\n"
        "    def __init__(self, config): super().__init__(); self.w = torch.nn.Linear(4, 4)\n"
        "    def configure_optimizers(self, wd, lr, betas, device): return torch.optim.AdamW(self.parameters(), lr)\n")

    def models():
        gc.collect()
        return {id(o): type(o).__module__ for o in gc.get_objects()
                if type(o).__name__ == "GPT" and isinstance(o, torch.nn.Module)}  # (type first: no deprecation)
    before, alive = models(), []

    def profiled_step(model, optimizer, batches, steps, compile):
        alive.append(sorted(m for i, m in models().items() if i not in before))
        return 1.0, float("nan"), "table"
    monkeypatch.setattr(gpu, "profiled_step", profiled_step)
    config = {**gpu.GPT2_SMALL, "n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 64}
    assert len(list(gpu.versus_profiles(str(tmp_path), config, 2, False, str(tmp_path)))) == 2
    assert alive == [["nanogpt_model"], ["model"]], alive


def test_seeds_and_threads_below_one_are_refused_in_one_line(monkeypatch):
    # --seeds=-1 ran no seed and ended in statistics' traceback over an empty table
    import bench
    from lib.files import UserError
    for bad in ("--seeds=-1", "--seeds=0", "--threads=0"):
        monkeypatch.setattr(sys, "argv", ["bench.py", "--mode=seeds", bad])
        with pytest.raises(UserError, match="must be at least 1"):
            bench.parse_args()


@pytest.mark.slow  # a LoRA run of train.py on a tiny Qwen3 folder: ~15 s
def test_lora_mode_counts_the_frozen_base_in_the_dtype_the_run_held_it(tmp_path, capsys):
    # on a CPU dtype='auto' is float32, and so is a LoRA run's frozen base (lora_base_dtype='auto'): its row's MB
    # are 4 bytes a frozen weight, not bf16's 2
    from benchmarks.gpu import TINY_QWEN3
    from benchmarks.measure import bench_lora
    from model import GPT, GPTConfig
    shape = dict(TINY_QWEN3, vocab_size=8192, n_embd=128, head_size=64)  # a ~4 MB embedding: MB the row shows
    bench_lora(["--device=cpu", "--compile=False", "--batch_size=1", "--block_size=32"], shape, "tiny Qwen3",
               skip=["full", "LoRA, int8 base", "QLoRA"], scratch=tmp_path, steps=4)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| LoRA |"))
    frozen = float(row.split(" | ")[3].replace(",", ""))
    assert frozen == round(GPT(GPTConfig(**shape)).num_params() * 4 / 2**20), row
