"""
A model's loss and perplexity over every token of a dataset's val split, each scored once, in block_size windows
overlapping by --stride tokens, as papers do. Conversations (masks) and runs trained on whole examples score each
example alone over its trained targets: a run's val loss here is its log's. Deterministic, to compare with transformers.

    python eval.py --out_dir=out-small                                   # a run's checkpoint, on its own data
    python eval.py --model=models/Qwen3-0.6B --data_dir=data/finetune --block_size=1024 --stride=512

Its last line: `val loss L perplexity P over N tokens`.

With --tasks, lm-evaluation-harness's tasks instead (pip install lm_eval): its table, and its results as JSON in
out_dir/eval_tasks.json (--output). Local task files (--include_path) work offline; its own tasks download data once.

    python eval.py --out_dir=out-small --tasks=hellaswag,arc_easy --limit=500
    python eval.py --model=models/Qwen3-0.6B --tasks=my_task --include_path=tasks/ --num_fewshot=5
"""

import argparse
import json
import os
import sys
from contextlib import nullcontext

import torch

from lib import harness
from lib.data import Split, longest_example
from lib.files import (UserError, check_meta_unchanged, check_token_files, one_line_errors, read_json, replaced_whole,
                       read_meta)
from lib.hf import eos_ids, folder_splits_special, load_pretrained
from lib.metrics import perplexity
from lib.parallel import pick_device
from lib.settings import EVALUATION, check_ranges
from lib.start import check_fused_ops
from lib.tokenizer import check_tokenizer
from lib.trained import (chat_folder, check_run_tokenizer, exported_eos_ids, load_folder_or_run, load_model,
                         splits_special)

one_line_errors("eval.py")
TEXT_WINDOW = 2048  # a folder's window over text without --block_size: at most this many tokens

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out_dir", default="out", help="the run whose checkpoint to score")
parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint in out_dir (ckpt_best.pt: best val loss)")
parser.add_argument("--model", default=None, help="a Hugging Face model folder to score instead of a run")
parser.add_argument("--data_dir", default=None, help="the prepared dataset (default: the run's)")
parser.add_argument("--block_size", type=int, default=None, help="the window (default: the run's block_size; for "
                    f"a folder, the longest val example, at most its limit, or {TEXT_WINDOW} tokens for text)")
parser.add_argument("--stride", type=int, default=None, help="tokens a window shares with the one before, its "
                    "context (default: a run's eval_stride under eval_full, where it fits; else half the window)")
parser.add_argument("--batch_size", type=int, default=8, help="windows (or a task's requests) at a time")
parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'mps'")
parser.add_argument("--dtype", default="auto", help="'float32', 'bfloat16', 'float16'; auto: the run's, else bf16 "
                    "on CUDA")
parser.add_argument("--tasks", default=None, help="lm-evaluation-harness tasks to run instead, comma-separated")
parser.add_argument("--limit", type=float, default=None, help="--tasks: at most this many items of each task "
                    "(below 1: this share of them; 0: all)")
parser.add_argument("--num_fewshot", type=int, default=None, help="--tasks: examples in each prompt (default: "
                    "the task's own)")
parser.add_argument("--include_path", default=None, help="--tasks: a folder of task files (YAML) of your own")
parser.add_argument("--apply_chat_template", action="store_true", help="--tasks: prompts through the model's "
                    "chat template (a model trained on conversations)")
parser.add_argument("--output", default=None, help="--tasks: where to write the results (default: "
                    "out_dir/eval_tasks.json, or eval_tasks.json here for a --model folder)")
args = parser.parse_args()
check_ranges(vars(args), EVALUATION, "--")  # as train.py's settings are checked
for flag in ("limit", "num_fewshot", "include_path", "apply_chat_template", "output"):
    if getattr(args, flag) not in (None, False) and args.tasks is None:  # else the val loss, and the flag unused
        raise UserError(f"--{flag} is a setting of --tasks: give --tasks=NAME,... with it, or leave it out")
if args.model and (args.out_dir, args.ckpt) != ("out", "ckpt.pt"):  # (else unused, and nothing said)
    raise UserError("--out_dir and --ckpt name a run's checkpoint, --model a folder to score instead: give one")
for flag in ("block_size", "stride"):
    if getattr(args, flag) is not None and args.tasks is not None:  # else unused, and nothing said
        raise UserError(f"--{flag} is a setting of the val loss, not of --tasks (the model's window): leave it out")

def run_dtype(checkpoint, device, dtype):
    # --dtype=auto for a run: its own, as its evaluations computed (where this device has it), else dtype
    held = checkpoint["config"]["dtype"] if checkpoint and args.dtype == "auto" else "auto"
    cuda_bf16 = not device.startswith("cuda") or torch.cuda.is_bf16_supported()
    return dtype if held == "auto" or held == "bfloat16" and not cuda_bf16 else held


def earlier_results(path):
    # the results eval.py wrote at path (a JSON object with lm_eval's "results", not too big), else None
    try:
        held = read_json(path)
    except (OSError, UserError):
        return None
    return held["results"] if isinstance(held, dict) and "results" in held else None


if args.tasks is not None:  # lm-evaluation-harness's tasks instead of the val loss
    # a model folder is someone else's (downloaded, perhaps): the results of one go to the current folder
    output = args.output or ("eval_tasks.json" if args.model else os.path.join(args.out_dir, "eval_tasks.json"))
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(output))):  # now, not after the tasks ran
        raise UserError(f"--output={output}: its folder does not exist (make it, or write elsewhere)")
    if not args.output and args.model and os.path.isdir(args.model) and os.path.samefile(".", args.model):
        raise UserError(f"the results would go to {output} in the model folder {args.model}: give --output=PATH")
    if os.path.lexists(output) and earlier_results(output) is None:  # (a checkpoint, metrics.jsonl, a config.json)
        raise UserError(f"--output={output} is a {'folder' if os.path.isdir(output) else 'file'} eval.py did not "
                        f"write, which the results would replace: write them elsewhere")
    manager, names = harness.load_tasks(args.tasks, args.include_path)
    device, dtype = pick_device(args.device, args.dtype)
    path = os.path.join(args.out_dir, args.ckpt)
    model, tokenizer, checkpoint = load_folder_or_run(args.model, path, getattr(torch, dtype), args.data_dir,
                                                      "the tasks' text", device)
    dtype = run_dtype(checkpoint, device, dtype)
    # a folder's chat template is beside its weights; a run's is the one sample.py chats with (trained.chat_folder)
    template_folder = args.model or chat_folder(checkpoint, tokenizer)
    model.eval().to(device)
    autocast = None if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))
    lm = harness.Model(model, tokenizer, device, autocast, args.batch_size, template_folder, args.model or path,
                       eos_ids(args.model, tokenizer) if args.model else exported_eos_ids(checkpoint, tokenizer),
                       folder_splits_special(args.model) if args.model else splits_special(checkpoint, tokenizer))
    limit = int(args.limit) if args.limit and args.limit >= 1 else args.limit
    results = harness.run_tasks(lm, manager, names, limit, args.num_fewshot, args.apply_chat_template)
    from lm_eval.utils import handle_non_serializable, make_table
    print(make_table(results))
    earlier = earlier_results(output)
    if earlier is not None:  # an earlier eval.py's (any other file was refused above): replaced, and said
        print(f"note: {output} held earlier results ({', '.join(sorted(earlier)) if isinstance(earlier, dict) else ''})"
              f", replaced by these: give --output=PATH to keep both")
    with replaced_whole(output, "w", encoding="utf-8") as f:  # lm_eval's results, less the per-item samples
        json.dump({k: v for k, v in results.items() if k != "samples"}, f, indent=2, default=handle_non_serializable,
                  ensure_ascii=False)
    print(f"results written to {output}")
    sys.exit(0)

# -----------------------------------------------------------------------------
# the model and the data

try:
    device, dtype = pick_device(args.device, args.dtype)
    if args.model:  # a folder: its weights, and data that must be made with its tokenizer
        if not args.data_dir:
            raise UserError("--model needs --data_dir, a dataset prepared with the folder's tokenizer")
        model = load_pretrained(args.model, getattr(torch, dtype), args.block_size)
        check_fused_ops(model.config.use_kernels, device)
        check_tokenizer(args.data_dir, read_meta(args.data_dir), args.model, model.config.vocab_size)
        data_dir = args.data_dir
    else:
        model, checkpoint = load_model(os.path.join(args.out_dir, args.ckpt), args.data_dir, device=device)
        dtype = run_dtype(checkpoint, device, dtype)
        if args.data_dir:  # another dataset than the run's must be made with its tokenizer
            check_run_tokenizer(args.data_dir, checkpoint, model.config.vocab_size)
        data_dir = checkpoint["data_dir"]
    meta = read_meta(data_dir)
    check_token_files(data_dir, meta, 0, splits=("val",))  # whole tokens, as many as meta.json says, in its vocabulary
except ValueError as e:
    raise UserError(str(e)) from None
by_example = bool(meta.get("masks")) or (not args.model and checkpoint["config"].get("sequences") == "examples")
if by_example and args.stride is not None:  # else unused, and nothing said
    raise UserError("--stride is a setting of text's windows, and each example is scored on its own: leave it out")
# a folder's window: the data's longest example (text: at most TEXT_WINDOW); its 32K or 128K limit costs gigabytes
if args.block_size:
    block_size, window_from = args.block_size, "--block_size"
elif not args.model:
    block_size, window_from = checkpoint["config"]["block_size"], "the run's block_size"
else:
    longest = longest_example(data_dir, meta)
    limit = model.config.block_size if by_example else min(model.config.block_size, TEXT_WINDOW)
    block_size = max(1, min(longest - 1, limit))
    window_from = (f"the longest val {'example' if by_example else 'document'} ({longest} tokens)"
                   + (f", cut to {limit}" if longest - 1 > limit else "") + "; --block_size sets it")
run = {} if args.model else checkpoint["config"]  # a run's windows are scored as its eval_full scored them
stride = args.stride
if stride is None:  # the eval_stride a run's eval_full scored with, where it fits the window; else half the window
    full = run.get("eval_full") and 0 <= run.get("eval_stride", -1) < block_size
    stride = run["eval_stride"] if full else block_size // 2
doc_mask = bool(run.get("doc_mask"))  # attending within documents, as it trained
if not 0 < block_size <= model.config.block_size:
    raise UserError(f"--block_size={block_size} must be in 1..{model.config.block_size} (the model's limit)")
if not 0 <= stride < block_size:  # (one not typed is below the window)
    raise UserError(f"--stride={stride} must be in 0..{block_size - 1}, below the window's {block_size} tokens")
print(f"window: {block_size} tokens, from {window_from}; computed in {dtype}")
try:
    val = Split(data_dir, "val", meta, block_size, seed=0, examples=by_example, vocab_size=model.config.vocab_size)
except (ValueError, OSError) as e:
    raise UserError(str(e)) from None
check_meta_unchanged(data_dir, meta)  # the val split just opened is the one meta.json described
if by_example and val.targets[0] == 0:
    raise UserError(f"no val example keeps a trained token within its first block_size + 1 = {block_size + 1} "
                    f"tokens: raise --block_size")
model.eval().to(device)

# -----------------------------------------------------------------------------
# every window (or sequence of whole examples); the loss summed over the scored tokens

windows = val.scored_count(stride)
autocast = nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))
loss_sum, count = 0.0, 0
for first in range(0, windows, args.batch_size):
    try:
        x, y, doc_ids = val.scored(range(first, min(first + args.batch_size, windows)), stride, doc_mask)
    except ValueError as e:
        raise UserError(str(e)) from None
    with autocast:
        doc_ids = None if doc_ids is None else doc_ids.to(device)  # whole examples: each attends only to itself
        loss, _ = model.loss_and_accuracy(x.to(device), y.to(device), doc_ids)
    scored = int((y != -1).sum())
    loss_sum += loss.item() * scored
    count += scored
if not count:  # (a val.bin of one token): no loss, and no perplexity of 1 over nothing
    raise UserError(f"{data_dir}/val.bin has nothing to score: its first token is no target, and it holds "
                    f"{len(val.tokens())} token(s) (prepare a longer val split)")
loss = loss_sum / count
if by_example:
    print(f"{len(val.lengths)} examples of {data_dir}/val.bin, each on its own (packed into {windows} sequences of "
          f"{block_size} tokens, attending within their example), over their trained targets"
          + (f"; {val.cut_note()}" if val.cut else ""))
else:
    print(f"{windows} windows of {block_size} tokens overlapping by {stride}, {data_dir}/val.bin"
          + (", attending within documents (the run's doc_mask)" if doc_mask else ""))
print(f"val loss {loss:.6f} perplexity {perplexity(loss):.4f} over {count} tokens")
