"""lm-evaluation-harness on our checkpoints (harness.py, eval.py --tasks, train.py's eval_tasks): item by item the
same as `lm_eval --model hf` on the run's export, on three local tasks the tests write (multiple choice in
HellaSwag's format, a rolling log-likelihood, a generation scored by exact match), offline."""

import json
import math
import shutil

import pytest
import torch

from helpers import ROOT, losses, run, script
from lib.files import UserError

ROOT_TASKS = ("tiny_hellaswag", "tiny_perplexity", "tiny_generate")
SHAPE = ["--n_layer=2", "--n_head=4", "--n_kv_head=2", "--n_embd=64", "--block_size=64", "--batch_size=4",
         "--eval_iters=2", "--log_interval=1", "--warmup_iters=2", "--lr_decay_iters=20", "--learning_rate=3e-3"]
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)


def needs_lm_eval():
    return pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional: pip install lm_eval")


def corpus_lines():
    from test_finetune import corpus_text
    return [line for line in corpus_text().splitlines() if 30 <= len(line.strip()) <= 70]


def write_tasks(folder):
    # three tasks over text like the corpus the models saw: YAML files pointing at jsonl files beside them
    folder.mkdir(parents=True, exist_ok=True)
    lines = [line.strip() for line in corpus_lines()[:400:10]]
    cut = [len(line) // 2 for line in lines]
    choices = [{"ctx": line[:c], "endings": [line[c:], *(lines[(i + k) % len(lines)][c:] for k in (1, 2, 3))],
                "label": i % 4} for i, (line, c) in enumerate(zip(lines[:8], cut))]
    for item in choices:  # the right ending at the label's place
        item["endings"][0], item["endings"][item["label"]] = item["endings"][item["label"]], item["endings"][0]
    texts = [{"text": "\n".join(lines[i:i + 6])} for i in range(0, 24, 6)]  # longer than a window: several
    # a special token's spelling in a text: text to a text run's export (split_special_tokens), a token to a base's
    texts[0]["text"] = texts[0]["text"].replace("\n", " <|endoftext|>\n", 1)
    questions = [{"question": line[:c], "answer": line[c:]} for line, c in zip(lines[10:16], cut[10:16])]
    for name, items in (("hs", choices), ("text", texts), ("qa", questions)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))

    def data(name):
        return f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}\ntest_split: test\n"
    (folder / "tiny_hellaswag.yaml").write_text(
        "task: tiny_hellaswag\n" + data("hs.jsonl") + "output_type: multiple_choice\ndoc_to_text: '{{ctx}}'\n"
        "doc_to_target: '{{label}}'\ndoc_to_choice: '{{endings}}'\nmetric_list:\n"
        "  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n")
    (folder / "tiny_perplexity.yaml").write_text(
        "task: tiny_perplexity\n" + data("text.jsonl") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n"
        + "".join(f"  - metric: {m}\n    aggregation: {a}\n    higher_is_better: false\n" for m, a in (
            ("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
            ("bits_per_byte", "bits_per_byte"))))
    (folder / "tiny_generate.yaml").write_text(
        "task: tiny_generate\n" + data("qa.jsonl") + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


@pytest.fixture(scope="module")
def tasks(shared):
    return shared("harness-tasks", write_tasks)


def make_run_here(root):
    # a model trained here from scratch on a byte-level BPE of the corpus (its export apart: the quick tier's
    # test reads the run alone)
    from test_finetune import corpus_text
    (root / "corpus").mkdir()
    (root / "corpus" / "text.txt").write_text(corpus_text())
    done = script("prepare.py", root / "corpus", "--tokenizer=bpe:300", f"--out_dir={root / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*SHAPE, f"--data_dir={root / 'data'}", f"--out_dir={root / 'run'}", "--max_iters=10", "--eval_interval=10")


@pytest.fixture(scope="module")
def run_here(shared):
    root = shared("harness-run", make_run_here)
    return root / "run", root / "data"


def export(out_dir, folder):
    done = script("export.py", f"--out_dir={out_dir}", f"--to={folder / 'hf'}")
    assert done.returncode == 0, done.stderr


def make_lora_run(root, pretrained):
    # an imported Qwen3-shaped model (test_finetune's tiny one, the session's shared folder) fine-tuned with LoRA,
    # and its merged export
    from test_finetune import LORA
    run(*LORA, f"--data_dir={pretrained / 'data'}", f"--init_from={pretrained / 'qwen'}",
        f"--out_dir={root / 'run'}", "--max_iters=6")
    export(root / "run", root)


# -----------------------------------------------------------------------------
# ours against lm_eval's Hugging Face model, item by item


def ours(out_dir, tasks_dir, batch_size=4):
    from lib import harness
    from lib.trained import exported_eos_ids, load_run, splits_special
    model, tokenizer, checkpoint = load_run(str(out_dir / "ckpt.pt"))
    lm = harness.Model(model.eval(), tokenizer, batch_size=batch_size, chat_folder=checkpoint["data_dir"],
                       eos_ids=exported_eos_ids(checkpoint, tokenizer),
                       split_special=splits_special(checkpoint, tokenizer))  # as eval.py's
    manager, names = harness.load_tasks(",".join(ROOT_TASKS), str(tasks_dir))
    return harness.run_tasks(lm, manager, names, log_samples=True, stderr=False)


def theirs(folder, tasks_dir):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager
    # the local tasks alone: the harness's own index of its hundreds of tasks (~15 s to build) is not needed
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)
    return simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float32", tasks=list(ROOT_TASKS),
                           task_manager=manager, log_samples=True,
                           bootstrap_iters=0, device="cpu", batch_size=8)


def assert_same(a, b, where):
    # per item: log-likelihoods within 1e-5 of their size (a sum over a continuation's tokens, whose float32
    # rounding grows with it: 1.1e-7 of it measured), greedy flags and generated text identical
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (where, a, b)
    else:
        assert a == b, (where, a, b)


def assert_same_results(mine, hf):
    for task in ROOT_TASKS:
        items, their_items = mine["samples"][task], hf["samples"][task]
        assert [s["doc_id"] for s in items] == [s["doc_id"] for s in their_items]
        for item, their in zip(items, their_items):
            assert_same(item["filtered_resps"], their["filtered_resps"], f"{task} item {item['doc_id']}")
        for key, value in hf["results"][task].items():
            if not isinstance(value, float) or "stderr" in key:  # the name, the alias, the count of items
                continue
            if key.startswith(("acc", "exact_match")):
                assert mine["results"][task][key] == value, (task, key)  # accuracy identical
            else:
                assert mine["results"][task][key] == pytest.approx(value, rel=1e-4), (task, key)


@pytest.mark.slow  # lm_eval's own Hugging Face model on the export beside ours: ~25 s
def test_a_run_trained_here_scores_as_its_export_under_lm_eval_hf(shared, run_here, tasks):
    needs_lm_eval()
    pytest.importorskip("transformers")
    out_dir = run_here[0]
    folder = shared("harness-run-export", lambda root: export(out_dir, root)) / "hf"
    mine, hf = ours(out_dir, tasks), theirs(folder, tasks)
    assert_same_results(mine, hf)
    generated = [s["filtered_resps"][0] for s in mine["samples"]["tiny_generate"]]
    assert any(generated), generated  # the comparison saw text, not only empty strings


@pytest.mark.slow  # a LoRA run on test_finetune's shared tiny Qwen3, and transformers' model: ~25 s
def test_an_imported_qwen3_with_lora_scores_as_its_export_under_lm_eval_hf(shared, tasks):
    needs_lm_eval()
    pytest.importorskip("transformers")
    from test_finetune import make_pretrained
    pretrained = shared("pretrained", make_pretrained)  # test_finetune's, built once for both files
    root = shared("harness-lora", lambda folder: make_lora_run(folder, pretrained))
    assert_same_results(ours(root / "run", tasks, batch_size=3), theirs(root / "hf", tasks))


@pytest.mark.slow  # a fine-tune of a copy of test_finetune's tiny Qwen3, its export, and eval.py on both: ~10 s
@pytest.mark.parametrize("named", [True, False], ids=["tokenizer_config names it", "generation_config alone"])
def test_a_run_from_a_folder_whose_texts_end_with_im_end_scores_as_its_export(shared, tasks, tmp_path, named):
    # a base whose tokenizer_config.json names <|im_end|> as eos_token, as a real Qwen3's does: lm_eval's end of text
    # (which begins every rolling window, and stands for an empty context) is it in the export, and so in the run
    # (eval.py on the run took the tokenizer's <|endoftext|>: every rolling item differed). Without that file the
    # export's tokenizer_config.json is its own, whose eos_token is the end of text, the run's too
    needs_lm_eval()
    tokenizers = pytest.importorskip("tokenizers")
    from test_finetune import FINETUNE, corpus_text, make_pretrained
    base = tmp_path / "qwen"
    shutil.copytree(shared("pretrained", make_pretrained) / "qwen", base)
    tok = tokenizers.Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.add_special_tokens(["<|im_end|>"])
    tok.save(str(base / "tokenizer.json"))
    ends = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    if named:
        (base / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "text.txt").write_text(corpus_text()[:100_000])
    done = script("prepare.py", tmp_path / "corpus", f"--tokenizer={base}", f"--out_dir={tmp_path / 'data'}")
    assert done.returncode == 0, done.stderr
    run(*FINETUNE, f"--data_dir={tmp_path / 'data'}", f"--init_from={base}", f"--out_dir={tmp_path / 'run'}",
        "--max_iters=2")
    export(tmp_path / "run", tmp_path)
    scores = []
    for which in (f"--out_dir={tmp_path / 'run'}", f"--model={tmp_path / 'hf'}"):
        done = eval_py(which, "--tasks=tiny_perplexity,tiny_hellaswag", f"--include_path={tasks}", "--batch_size=2",
                       f"--output={tmp_path / 'results.json'}")
        assert done.returncode == 0, done.stderr
        results = json.loads((tmp_path / "results.json").read_text())["results"]
        scores.append({f"{task}/{key}": value for task in results for key, value in results[task].items()
                       if isinstance(value, float) and "stderr" not in key})
    assert scores[0] == pytest.approx(scores[1], rel=1e-6) and scores[0]


# -----------------------------------------------------------------------------
# the script: the table, the JSON, and one line for each thing a user can get wrong


@pytest.mark.slow  # lm_eval's import alone is seconds
def test_eval_py_tasks_prints_the_table_and_writes_json(run_here, tasks, tmp_path):
    needs_lm_eval()
    out_dir, _ = run_here
    output = tmp_path / "results.json"
    done = script("eval.py", f"--out_dir={out_dir}", f"--tasks={','.join(ROOT_TASKS)}", f"--include_path={tasks}",
                  "--limit=3", "--batch_size=2", f"--output={output}", env=OFFLINE)
    assert done.returncode == 0, done.stderr
    assert all(f"|{task}" in done.stdout.replace(" ", "") for task in ROOT_TASKS), done.stdout
    results = json.loads(output.read_text())["results"]
    assert set(ROOT_TASKS) <= results.keys() and 0 <= results["tiny_hellaswag"]["acc,none"] <= 1
    assert math.isfinite(results["tiny_perplexity"]["word_perplexity,none"])
    # again, one task: the earlier results are replaced, and that is said (it was not)
    again = script("eval.py", f"--out_dir={out_dir}", "--tasks=tiny_perplexity", f"--include_path={tasks}",
                   "--limit=3", "--batch_size=2", f"--output={output}", env=OFFLINE)
    assert f"note: {output} held earlier results ({', '.join(sorted(results))}), replaced by these: give " \
        "--output=PATH to keep both" in again.stdout, again.stdout
    assert json.loads(output.read_text())["results"].keys() == {"tiny_perplexity"}


def eval_py(*args, path="eval.py"):
    # eval.py in this process (helpers.script), whose uncaught UserError goes through the script's one_line_errors
    return script(path, *args, "--device=cpu", env=OFFLINE)


def one_line(done, *words):
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and lines[0].startswith("eval.py: "), done.stderr
    assert all(word in lines[0] for word in words), lines[0]


def test_without_lm_eval_one_line_says_how_to_install_it(tmp_path):
    # eval.py run as __main__ by a script that first hides lm_eval, if installed: importing it fails as if it were
    # not (a PYTHONPATH hiding it would cost a new Python, torch's import included)
    hide = tmp_path / "without_lm_eval.py"
    hide.write_text(f"import runpy, sys\nsys.modules['lm_eval'] = None\nsys.path[0] = {str(ROOT)!r}\n"
                    f"runpy.run_path({str(ROOT / 'eval.py')!r}, run_name='__main__')\n")
    done = eval_py(f"--out_dir={tmp_path}", "--tasks=hellaswag", path=hide)
    one_line(done, "pip install lm_eval")


def remote_task(folder):
    # a task file whose data is on the Hub alone: offline, it cannot be loaded
    folder.mkdir(exist_ok=True)
    (folder / "remote.yaml").write_text(
        "task: remote_task\ndataset_path: nobody-here/no-such-dataset\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\ndoc_to_choice: ['a', 'b']\n")
    return folder



@pytest.mark.slow  # lm_eval's import alone is seconds
def test_a_limit_of_0_scores_every_item_as_train_pys_eval_tasks_limit_does(run_here, tasks):
    needs_lm_eval()
    from lib import harness
    from lib.trained import load_run
    model, tokenizer, _ = load_run(str(run_here[0] / "ckpt.pt"))
    lm = harness.Model(model.eval(), tokenizer, batch_size=4)
    manager, names = harness.load_tasks("tiny_hellaswag", str(tasks))
    counts = [harness.run_tasks(lm, manager, names, limit=limit, stderr=False)["n-samples"]["tiny_hellaswag"]
              for limit in (0, None, 2)]
    assert counts[0] == counts[1] and counts[0]["effective"] > counts[2]["effective"] == 2


def test_tasks_need_an_end_of_text_token_which_nanogpts_characters_lack():
    from lib import harness
    from lib.tokenizer import Tokenizer
    from model import GPT, GPTConfig
    characters = Tokenizer("nanogpt_char", "nanogpt_char", 3, None, chars=["a", "b", "c"])
    with pytest.raises(UserError, match="^lm-evaluation-harness tasks need an end-of-text token"):
        harness.Model(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)), characters)

@pytest.mark.slow  # an unknown name is looked for in the harness's whole index of tasks: ~15 s
def test_an_unknown_task_and_unreachable_data_are_one_line(tasks, tmp_path):
    needs_lm_eval()
    from lib import harness
    from lib.files import UserError
    # The unknown name in this process (the index built once, not in a script each time): eval.py and train.py
    # raise load_tasks's UserError uncaught, and their one_line_errors print it, as the data below shows end to end
    with pytest.raises(UserError, match="no task no_such_task") as refused:
        harness.load_tasks("no_such_task", str(tasks))
    assert "\n" not in str(refused.value)
    (tmp_path / "broken").mkdir()  # a task file that does not parse, which lm_eval leaves out without a word
    (tmp_path / "broken" / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    with pytest.raises(UserError, match=r"no task broken nor in .*broken \(whose files lm_eval cannot parse it "
                                        r"leaves out: check the YAML\)$"):
        harness.load_tasks("broken", str(tmp_path / "broken"))
    with pytest.raises(UserError, match=r"the task folder .*nowhere is not a folder"):  # (it said the task was not in
        harness.load_tasks("tiny_hellaswag", str(tmp_path / "nowhere"))  # it, whose YAML was to check)
    done = eval_py(f"--out_dir={tmp_path}", "--tasks=remote_task", f"--include_path={remote_task(tmp_path)}")
    one_line(done, "cannot load the data of remote_task")
    # results that could not be written once the tasks ran: refused before they run
    done = eval_py(f"--out_dir={tmp_path}", "--tasks=remote_task", f"--output={tmp_path / 'no' / 'r.json'}")
    one_line(done, f"--output={tmp_path / 'no' / 'r.json'}: its folder does not exist")
    (tmp_path / "metrics.jsonl").write_text('{"iter": 0, "loss": 4.2}\n{"iter": 1, "loss": 4.1}\n')  # a file of the run's
    done = eval_py(f"--out_dir={tmp_path}", "--tasks=remote_task", f"--output={tmp_path / 'metrics.jsonl'}")
    one_line(done, f"--output={tmp_path / 'metrics.jsonl'} is a file eval.py did not write, which the results would")
    done = eval_py(f"--out_dir={tmp_path}", "--tasks=remote_task", f"--output={tmp_path / 'broken'}")
    one_line(done, f"--output={tmp_path / 'broken'} is a folder eval.py did not write, which the results would")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"iter": 0, "loss": 4.2}\n{"iter": 1, "loss": 4.1}\n'
    # run in a model folder, the results would go into it (the default output is the current folder's)
    done = script("eval.py", f"--model={tmp_path}", "--tasks=remote_task", "--device=cpu", cwd=tmp_path, env=OFFLINE)
    one_line(done, f"the results would go to eval_tasks.json in the model folder {tmp_path}: give --output=PATH")


def test_a_continuation_that_cannot_be_scored_is_one_line():
    # an empty one would score 0 and count as greedy (an empty choice always picked), a longer one than the model's
    # window would fail in the arithmetic: HFLM asserts both, here each is one line naming it
    needs_lm_eval()
    from lib import harness
    from lib.files import UserError
    from lib.tokenizer import make_tokenizer
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("char", lambda: iter(["an apple a day\n"]))
    lm = harness.Model(GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32)).eval(), tokenizer)
    with pytest.raises(UserError, match="^a task's continuation '' is empty, which cannot be scored"):
        lm.loglikelihood([Request("an apple", "")])
    with pytest.raises(UserError, match="continuation ' a day a day' is 12 tokens, past block_size=8"):
        lm.loglikelihood([Request("an apple", " a day a day")])
    assert len(lm.loglikelihood([Request("an apple", " a day")])) == 1
    # a context of whitespace alone, which lm_eval's split moves into the continuation (an index error before)
    with pytest.raises(UserError, match=r"^a task's context '\\n' is whitespace alone, which lm_eval moves into the "
                                        r"continuation, leaving nothing to score it after: mend the task's context$"):
        lm.loglikelihood([Request("\n", "an")])
    # an empty context to generate from begins with the prefix token, as an empty one to score does
    written = [i for i in lm.greedy([lm.prefix_token_id], 4, []) if i not in lm.eos_ids]
    assert lm.generate_until([Request("", {"until": ["@"], "max_gen_toks": 4})]) == [tokenizer.decode(written)]
    # a model whose every next token is 'a': what it writes is cut before the first stop string, and a continuation
    # is greedy where it is what greedy would write

    class Always(torch.nn.Module):
        blocks, config = [], GPTConfig(vocab_size=64, block_size=8)

        def forward(self, x, cache=None):
            return torch.nn.functional.one_hot(torch.full(x.shape, tokenizer.encode("a")[0]), 64).float(), None
    always = harness.Model(Always(), tokenizer)
    assert always.generate_until([Request("an", {"until": ["ap", "aa"], "max_gen_toks": 4})]) == [""]
    assert always.generate_until([Request("an", {"until": ["@"], "max_gen_toks": 3})]) == ["aaa"]
    assert [greedy for _, greedy in always.loglikelihood([Request("an", " aa"), Request("an", "aa"),
                                                          Request("an", "ap")])] == [False, True, False]
    # a task that samples, or generates a block's worth, is one line
    with pytest.raises(UserError, match="^this model generates greedily only"):
        lm.generate_until([Request("an", {"until": ["@"], "do_sample": True, "temperature": 0.8})])
    with pytest.raises(UserError, match="up to 8 tokens, at least the model's block_size=8"):
        lm.generate_until([Request("an", {"until": ["@"], "max_gen_toks": 8})])


class Request:  # what lm_eval passes a model: its args
    def __init__(self, *args):
        self.args = args


# -----------------------------------------------------------------------------
# during training


def task_records(out_dir):
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iter"]: r["tiny_hellaswag/acc"] for r in records if "val_loss" in r}


@pytest.mark.slow  # four training runs, three of them with the tasks at each evaluation
def test_a_score_takes_the_log_softmax_of_its_continuations_rows_alone(monkeypatch):
    # over every row of a batch in fp32 it took twice the logits' bytes again, in fp32 (a rolling task's 40k windows
    # over 152k tokens, 8 a batch: 185 GiB twice); over the continuation's rows, the same scores
    needs_lm_eval()
    from lib import harness
    from lib.tokenizer import make_tokenizer
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("char", lambda: iter(["an apple a day\n"]))
    torch.manual_seed(0)
    lm = harness.Model(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval(), tokenizer)
    requests = [Request("an apple", " a day"), Request("a", " day")]
    before = lm.loglikelihood(requests)
    shapes, log_softmax = [], harness.F.log_softmax
    monkeypatch.setattr(harness.F, "log_softmax", lambda x, dim: shapes.append(tuple(x.shape)) or log_softmax(x, dim))
    assert lm.loglikelihood(requests) == before
    assert shapes == [(6, 64), (4, 64)]


def test_training_logs_the_task_metric_and_resumes_exactly(run_here, tasks, tmp_path):
    needs_lm_eval()
    data = run_here[1]
    args = [*SHAPE, f"--data_dir={data}", "--eval_interval=4", "--eval_tasks=tiny_hellaswag",
            f"--eval_tasks_path={tasks}", "--eval_tasks_limit=4", "--dropout=0.1"]
    whole = run(*args, f"--out_dir={tmp_path / 'whole'}", "--max_iters=8", env=OFFLINE)
    assert "tiny_hellaswag/acc" in whole.stdout
    scores = task_records(tmp_path / "whole")
    assert sorted(scores) == [0, 4, 8] and all(0 <= s <= 1 for s in scores.values())
    plain = [a for a in args if not a.startswith("--eval_tasks")]
    run(*plain, f"--out_dir={tmp_path / 'plain'}", "--max_iters=8")
    assert losses(tmp_path / "whole") == losses(tmp_path / "plain")  # the tasks took nothing from training's RNG
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=4", env=OFFLINE)
    run(*args, f"--out_dir={tmp_path / 'parts'}", "--max_iters=8", "--init_from=resume", env=OFFLINE)
    assert losses(tmp_path / "whole") == losses(tmp_path / "parts")  # dropout's stream went on untouched
    assert task_records(tmp_path / "whole") == task_records(tmp_path / "parts")


@pytest.mark.slow
def test_training_refuses_a_task_it_cannot_load_or_score_before_the_first_step(run_here, tasks, tmp_path):
    # load_tasks's refusal, the one for data that cannot be reached: an unknown name (the same UserError from the
    # same call, test_an_unknown_task_and_unreachable_data_are_one_line) would cost the harness's whole index
    needs_lm_eval()
    data = run_here[1]
    done = run(*SHAPE, f"--data_dir={data}", f"--out_dir={tmp_path / 'run'}", "--eval_tasks=remote_task",
               f"--eval_tasks_path={remote_task(tmp_path / 'tasks')}", "--max_iters=2", check=False, env=OFFLINE)
    assert done.returncode != 0 and "cannot load the data of remote_task" in done.stderr
    assert "iter 1" not in done.stdout
    # a task that loads but cannot be scored (it generates past block_size=64): refused before a resume's first step
    # too, whose first evaluation comes steps later (they were trained, then lost with the run)
    (tmp_path / "long").mkdir()
    (tmp_path / "long" / "tiny_long.yaml").write_text((tasks / "tiny_generate.yaml").read_text().replace(
        "task: tiny_generate", "task: tiny_long").replace("max_gen_toks: 8", "max_gen_toks: 100"))
    shutil.copytree(run_here[0], tmp_path / "resumed")
    done = run(*SHAPE, f"--data_dir={data}", f"--out_dir={tmp_path / 'resumed'}", "--init_from=resume",
               "--max_iters=14", "--eval_interval=4", "--eval_tasks=tiny_long",
               f"--eval_tasks_path={tmp_path / 'long'}", check=False, env=OFFLINE)
    assert done.returncode == 1 and "the task generates up to 100 tokens, at least the model's block_size=64" \
        in done.stderr and "iter 11" not in done.stdout, done.stdout + done.stderr


def bos_llama(folder):
    # a tiny Llama whose tokenizer.json puts <|begin_of_text|> before a text (Llama 3's way), its weights scaled up
    # from transformers' init so that what it is given (a BOS or not) changes its scores
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(corpus_lines(), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|begin_of_text|>", "<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder


@pytest.mark.slow  # lm_eval's Hugging Face model beside ours: ~10 s
def test_a_folder_whose_tokenizer_adds_a_bos_scores_as_under_lm_eval_hf(tmp_path):
    # loglikelihood (an empty context too), rolling windows and generation read the text with its BOS first and
    # begin empty contexts and windows with it, as HFLM does
    needs_lm_eval()
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lib import harness
    from lib.hf import load_pretrained
    from lib.tokenizer import make_tokenizer
    folder = str(bos_llama(tmp_path / "llama"))
    mine = harness.Model(load_pretrained(folder, torch.float32).eval(), make_tokenizer(folder, None), batch_size=4,
                         chat_folder=folder)
    hf = HFLM(pretrained=folder, dtype="float32", device="cpu", batch_size=4)
    pairs = [("def foo(x):", " return x"), ("import", " sys"), ("", "import os")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    assert_same(mine.loglikelihood(requests), hf.loglikelihood(requests), "loglikelihood")
    requests = [Instance("loglikelihood_rolling", {}, ("import os\nimport sys\n" * 12,), 0)]
    assert_same(mine.loglikelihood_rolling(requests), hf.loglikelihood_rolling(requests), "rolling")
    requests = [Instance("generate_until", {}, ("def foo(x):", {"until": ["\n\n"], "max_gen_toks": 10}), 0)]
    assert_same(mine.generate_until(requests), hf.generate_until(requests), "generate_until")


def test_generation_never_writes_a_padding_row(tmp_path):
    # the model's vocabulary is the tokenizer's padded to a multiple of 64: the rows past it decode to nothing (a
    # bpe tokenizer's decode raises), so the tasks' generation leaves them out, as sample.py does
    needs_lm_eval()
    import torch
    from lib import harness
    from lib.tokenizer import make_tokenizer
    from model import GPT, GPTConfig
    tokenizer = make_tokenizer("char", lambda: iter(["an apple a day\n"]))
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=32, tie_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight[tokenizer.vocab_size:] = 5 * model.lm_head.weight[:tokenizer.vocab_size].abs().max()
    new = harness.Model(model, tokenizer).greedy(tokenizer.encode("an apple"), 8, [])
    assert new and max(new) < tokenizer.vocab_size


def test_a_folder_ends_its_texts_with_its_own_eos_as_under_lm_eval_hf(tmp_path):
    # Qwen3's tokenizer holds <|endoftext|> but ends a reply with <|im_end|>, its tokenizer_config.json's eos, and
    # generation_config.json may add more: lm_eval's end of text (the rolling windows' first token without a BOS)
    # is that eos, and generation stops at any of them, as transformers reads the folder
    needs_lm_eval()
    import torch
    from lib import harness
    from lib.hf import eos_ids
    from lib.tokenizer import make_tokenizer
    from model import GPTConfig
    from test_chat import make_folder
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    tokenizer = make_tokenizer(str(folder), None)
    specials = tokenizer.special_tokens()
    assert tokenizer.eot_id == specials["<|endoftext|>"] != specials["<|im_end|>"]
    assert eos_ids(folder, tokenizer) == [specials["<|im_end|>"]]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [specials["<|im_start|>"], 100]}))
    ids = eos_ids(folder, tokenizer)
    assert ids == [specials["<|im_end|>"], specials["<|im_start|>"], 100]

    class Always(torch.nn.Module):  # a model whose every next token is <|im_start|>
        blocks, config = [], GPTConfig(vocab_size=448, block_size=32)

        def forward(self, x, cache=None):
            return torch.nn.functional.one_hot(torch.full(x.shape, specials["<|im_start|>"]), 448).float(), None
    lm = harness.Model(Always(), tokenizer, eos_ids=ids)
    assert lm.eot_token_id == lm.prefix_token_id == specials["<|im_end|>"]
    assert lm.greedy(tokenizer.encode("Paris"), 8, []) == [specials["<|im_start|>"]]  # it ends generation
    assert harness.Model(Always(), tokenizer).eot_token_id == tokenizer.eot_id  # a run's: its data's end of text


def test_a_chat_tasks_answer_prefix_continues_the_reply_as_under_lm_eval_hf(tmp_path):
    # under --apply_chat_template a task's gen_prefix ("Answer:") is the assistant's message, which the answer
    # continues: HFLM renders it with continue_final_message, the turn left open, and so does the harness here
    needs_lm_eval()
    transformers = pytest.importorskip("transformers")
    from lib import harness
    from lib.tokenizer import make_tokenizer
    from test_chat import make_folder
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    lm, theirs = harness.Model(None, make_tokenizer(str(folder), None), chat_folder=str(folder)), \
        transformers.AutoTokenizer.from_pretrained(str(folder))
    chat = [{"role": "user", "content": "Which city is the capital of France?"}, {"role": "assistant", "content": "A:"}]
    opened = lm.apply_chat_template(chat, add_generation_prompt=False)
    assert opened.endswith("\nA:") and opened == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert lm.apply_chat_template(chat[:1]) == theirs.apply_chat_template(chat[:1], tokenize=False,
                                                                          add_generation_prompt=True)
