"""
lm-evaluation-harness on our own model, in this process: Model answers the harness's requests with our GPT, its
KV cache and tokenizer; run_tasks runs tasks by name, as `lm_eval --tasks` does; task_metrics is what train.py logs
at each evaluation. lm_eval is optional (pip install lm_eval). Requests are tokenized as lm_eval's Hugging Face model
(HFLM) does, so a checkpoint scores here what its export scores under `lm_eval --model hf`, item by item.
"""

import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from lib.chat import ChatFormat
from lib.files import UserError
from lib.tokenizer import load_tokenizer

try:
    from lm_eval.api.model import TemplateLM
except ImportError:  # optional: a script that runs a task says how to install it (load_tasks)
    TemplateLM = object


class Model(TemplateLM):
    """Our GPT and tokenizer as an lm_eval model (TemplateLM: lm_eval's LM, tokenizing requests as HFLM does)."""
    max_gen_toks = 256  # HFLM's default
    dry = False  # True: each request is checked, not scored (for_training's check before the first step)

    def __init__(self, model, tokenizer, device="cpu", autocast=None, batch_size=8, chat_folder=None, name="gpt",
                 eos_ids=None, split_special=False):
        # chat_folder: where the model's chat template is (its data's meta.json, or its Hugging Face folder); eos_ids:
        # the ids that end a text (a folder's: hf.eos_ids), the first lm_eval's end of text, else the tokenizer's;
        # split_special: a special token's spelling in a text is text, as its export says (trained.splits_special)
        super().__init__()
        if tokenizer.eot_id is None:  # what ends a generated answer, and begins a rolling window
            raise UserError("lm-evaluation-harness tasks need an end-of-text token, which nanoGPT's characters "
                            "(meta.pkl) lack: prepare the text with prepare.py (--tokenizer=char has one)")
        self.model, self.tokenizer, self.name, self.chat_folder = model, tokenizer, name, chat_folder
        self._device, self.autocast, self.batch_size = torch.device(device), autocast or nullcontext(), batch_size
        self.specials = set(tokenizer.special_tokens().values())
        self.split_special = split_special
        self.eos_ids = eos_ids or [tokenizer.eot_id]

    @property
    def device(self):  # (lm_eval's LM has it too; here also where this module was imported without lm_eval)
        return self._device

    @property
    def eot_token_id(self):
        return self.eos_ids[0]

    @property
    def prefix_token_id(self):  # HFLM's: what an empty context and the rolling windows begin with
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self.eot_token_id

    @property
    def max_length(self):  # as HFLM reads it from config.json's max_position_embeddings: the model's limit
        return self.model.config.block_size

    @property
    def tokenizer_name(self):
        return self.name

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        # as HFLM with the export's tokenizer: a special token written in the text (<|im_end|>) is that token unless
        # split_special, and a tokenizer.json's BOS (Llama 3's; prepare.py's before each document) leads unless asked
        # not to or already there
        chat = self.specials and not self.split_special
        ids = self.tokenizer.encode_chat(string, [])[0].tolist() if chat else self.tokenizer.encode(string)
        bos = self.tokenizer.bos_id
        written = bos is not None and string.startswith(self.tokenizer.decode([bos]))
        if bos is not None and add_special_tokens is not False and not written:
            ids = [bos, *ids]
        return ids

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        if getattr(self, "chat", None) is None:
            self.chat = ChatFormat.for_tokenizer(self.chat_folder, self.tokenizer.special_tokens(),
                                                 self.tokenizer.decode([self.tokenizer.eot_id]))
            if self.chat.origin == "built-in":
                raise UserError(f"--apply_chat_template needs a model trained on conversations: "
                                f"{self.chat_folder} has no chat template")
        if add_generation_prompt or not chat_history:
            return self.chat.render(chat_history, add_generation_prompt=add_generation_prompt)
        # else HFLM's continue_final_message: the last message left open (a task's gen_prefix, "Answer:"), cut, as
        # transformers cuts it, where a tag put after its content lands
        tag = "\ue004"  # (a private-use character no text holds)
        last = {**chat_history[-1], "content": f"{chat_history[-1].get('content', '')}{tag}"}
        text = self.chat.render([*chat_history[:-1], last])
        if tag not in text:
            raise UserError(f"the chat template ({self.chat.origin}) does not write the last message's content, which "
                            f"a task's answer continues: use a template that does")
        return text[:text.rindex(tag)]

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        # requests: (strings, context ids, continuation ids) -> (log-likelihood of the continuation, whether greedy
        # decoding writes it), with HFLM's truncation: the last max_length + 1 tokens, less the last one
        for strings, context, continuation in requests:  # (HFLM asserts all three)
            if not context:  # ("" is the prefix token by now: whitespace alone went to the continuation, lm_eval's)
                raise UserError(f"a task's context {strings[0][:60]!r} is whitespace alone, which lm_eval moves into "
                                f"the continuation, leaving nothing to score it after: mend the task's context")
            if not 0 < len(continuation) <= self.max_length:
                said = f"{strings[1][:60]!r} " if strings else ""
                why = f"{len(continuation)} tokens, past block_size={self.max_length}" if continuation else "empty"
                raise UserError(f"a task's continuation {said}is {why}, which cannot be scored: mend the task's "
                                f"choices or targets")
        if self.dry:
            return [(0.0, False)] * len(requests)
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        results = [None] * len(requests)
        for first in range(0, len(order), self.batch_size):
            chunk = order[first:first + self.batch_size]
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1] for i in chunk]
            x = torch.nn.utils.rnn.pad_sequence([torch.tensor(ids, dtype=torch.long) for ids in inputs],
                                                batch_first=True)  # right-padded
            with torch.no_grad(), self.autocast:
                logits, _ = self.model(x.to(self.device))
            for i, ids, row in zip(chunk, inputs, logits):  # (log_softmax of the scored rows alone, in fp32: of
                # all of them, a 40k window's batch of 8 over 152k tokens took 185 GiB twice over)
                continuation = torch.tensor(requests[i][2], device=row.device)
                scored = F.log_softmax(row[len(ids) - len(continuation):len(ids)].float(), dim=-1)  # (continuation, V)
                greedy = bool((scored.argmax(dim=-1) == continuation).all())
                results[i] = (float(scored.gather(1, continuation[:, None]).sum()), greedy)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        # each text scored whole, in windows of max_length that predict every token once (HFLM's windows)
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        totals = []
        for (text,) in [request.args for request in requests]:
            windows = get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1)
            pieces = [(None, *make_disjoint_window(window)) for window in windows]
            totals.append(sum(ll for ll, _ in self._loglikelihood_tokens(pieces)))
        return totals

    @torch.no_grad()
    def generate_until(self, requests, disable_tqdm=False):
        # greedy, one request at a time with the KV cache, until a stop string (or end-of-text) is written
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
        eos = self.tokenizer.decode([self.eot_token_id])
        out = []
        for context, gen_kwargs in [request.args for request in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0) > 0:
                raise UserError("this model generates greedily only: the task asks for sampling (do_sample)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            if max_new >= self.max_length:
                raise UserError(f"the task generates up to {max_new} tokens, at least the model's block_size="
                                f"{self.max_length}: give it a smaller max_gen_toks")
            if self.dry:
                out.append("")
                continue
            # an empty context begins from the prefix token, as an empty one does when scored (HFLM's would fail)
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            new = self.greedy(ids, max_new, until)
            text = self.tokenizer.decode([i for i in new if i not in self.specials and i not in self.eos_ids])
            out.append(postprocess_generated_text(text, until, None))
        return out

    def greedy(self, ids, max_new, until):
        cache = [[] for _ in self.model.blocks]
        x, new = torch.tensor([ids], device=self.device), []
        for _ in range(max_new):
            with self.autocast:
                logits, _ = self.model(x, cache=cache)
            new.append(int(logits[0, -1, :self.tokenizer.vocab_size].float().argmax()))  # not a padding row
            if new[-1] in self.eos_ids or any(stop in self.tokenizer.decode(new) for stop in until):
                break
            x = torch.tensor([new[-1:]], device=self.device)
        return new


# -----------------------------------------------------------------------------
# running tasks

def load_tasks(names, include_path=None):
    """(A TaskManager, the task names) of a comma-separated string, their data loaded once to fail early."""
    try:
        import lm_eval
        import lm_eval.api.model  # noqa: F401 (the submodules this file uses)
        import lm_eval.models.utils  # noqa: F401
        import lm_eval.tasks  # noqa: F401
    except ImportError:
        raise UserError("the evaluation harness is not installed: pip install lm_eval") from None
    from lm_eval.tasks import TaskManager
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    if not wanted:
        raise UserError("no task named: give --tasks=NAME[,NAME...] (hellaswag, arc_easy, or a local task file's)")
    if include_path and not os.path.isdir(include_path):
        raise UserError(f"the task folder {include_path} is not a folder: give --include_path a folder of task files")
    if include_path:  # a task folder is code, as a config file is (docs/checkpoints.md, 'What is checked')
        print(f"task files from {os.path.abspath(include_path)}: lm-evaluation-harness runs their !function modules "
              f"and renders their templates unsandboxed (load only folders you trust)", flush=True)
    # the harness's own index of its hundreds of tasks takes seconds to build: not for tasks all in include_path
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(name not in manager.all_tasks for name in wanted):
        manager = TaskManager(include_path=include_path)
    unknown = [name for name in wanted if name not in manager.all_tasks]
    if unknown:
        where = (f" nor in {include_path} (whose files lm_eval cannot parse it leaves out: check the YAML)"
                 if include_path else " (a local task: --include_path=DIR)")
        raise UserError(f"lm_eval {lm_eval.__version__} has no task {', '.join(unknown)}{where}")
    try:
        manager.load(wanted)
    except Exception as e:  # no network, a missing file, a dataset the Hub does not have: the harness's own errors
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"cannot load the data of {', '.join(wanted)} ({type(e).__name__}: {first[:300]}); "
                        f"offline, a task needs its data in the Hugging Face cache or a local task file") from None
    return manager, wanted


def run_tasks(lm, manager, names, limit=None, num_fewshot=None, apply_chat_template=False, log_samples=False,
              stderr=True):
    """lm_eval's simple_evaluate on our model; limit: at most this many items of each task (below 1: this share of
    them; 0 or None: all); stderr=False skips the standard errors' bootstrap (slower than tasks)."""
    from lm_eval.evaluator import simple_evaluate
    lm.model.eval()
    return simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit or None, num_fewshot=num_fewshot,
                           apply_chat_template=apply_chat_template, log_samples=log_samples,
                           bootstrap_iters=100_000 if stderr else 0, verbosity="WARNING")


def main_metrics(results):
    """{task/metric: value} of each task's first metric, as train.py logs them."""
    out = {}
    for task, values in results["results"].items():
        metric = next(iter(results["higher_is_better"].get(task, {})), None)
        key = next((k for k in values if metric and k.split(",")[0] == metric), None)
        if key is not None and isinstance(values[key], (int, float)):
            out[f"{task}/{metric}"] = float(values[key])
    return out


def for_training(model, run, device, autocast, batch_size, tasks, include_path, limit=None):
    """train.py's (Model, TaskManager, task names), the tasks loaded and each of their requests (of limit items)
    checked before the first step, not at an evaluation steps later; run: what its checkpoints hold beside the
    tensors (data_dir, pretrained, data_fingerprint)."""
    from lib.trained import exported_eos_ids, splits_special
    manager, names = load_tasks(tasks, include_path or None)
    tokenizer = load_tokenizer(run["data_dir"])
    lm = Model(model, tokenizer, device, autocast, batch_size, run["data_dir"], "training",
               exported_eos_ids(run, tokenizer), splits_special(run, tokenizer))
    lm.dry = True
    task_metrics(lm, manager, names, limit)
    lm.dry = False
    return lm, manager, names


def task_metrics(lm, manager, names, limit=None):
    """main_metrics of the model as it is now, leaving every random state and its train/eval mode unchanged."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    training = lm.model.training
    try:
        return main_metrics(run_tasks(lm, manager, names, limit=limit, stderr=False))
    finally:
        lm.model.train(training)
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
