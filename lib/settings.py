"""
Every setting of a training run, with its default: a module-level name of a plain type (int, float, bool, str or
None) not beginning with an underscore, which config files and --key=value arguments override (configurator.py).
The model's settings are GPTConfig's fields (model.py); the checks read the optimizers from optim.OPTIMIZERS and
the ways to draw sequences from data.SEQUENCES.

    config = settings.defaults()        # {'out_dir': 'out', 'eval_interval': 250, ...}
    settings.check(config)              # a UserError in one line for a value no run can use
"""

import dataclasses as _dataclasses
import importlib as _importlib
import math as _math

from lib import data as _data
from lib import optim as _optim
from lib.files import UserError as _UserError
from model import GPTConfig as _GPTConfig

# I/O
out_dir = "out"  # checkpoints and metrics.jsonl go here
eval_interval = 250  # estimate train/val loss (and maybe checkpoint) every this many steps
log_interval = 10  # print and record training metrics every this many steps
eval_iters = 50  # batches of batch_size per loss estimate, per process (under 'auto': the batch_size it splits)
eval_full = False  # the val loss over every token of val.bin once, in overlapping windows (as perplexity in papers)
eval_stride = -1  # eval_full: tokens each window shares with the one before (context, not scored); -1: half a window
eval_tasks = ""  # lm-evaluation-harness tasks to score at each evaluation, comma-separated (pip install lm_eval)
eval_tasks_limit = 0  # at most this many items of each task (0: all of them)
eval_tasks_path = ""  # a folder of task files of your own (lm_eval's --include_path)
always_save_checkpoint = True  # save at every evaluation, not only when val loss improves
eval_only = False  # evaluate once (train and val loss) and exit, writing nothing (nanoGPT's)
init_from = "scratch"  # 'scratch', 'resume' (out_dir/ckpt.pt), 'auto' (resume if there is one), or a HF model folder
keep_last_n = 0  # also keep this many step checkpoints ckpt_NNNNNNN.pt (0: only ckpt.pt and ckpt_best.pt)
save_every_epoch = False  # also save at the end of each epoch N, and keep that as ckpt_epoch_N.pt
early_stop_patience = 0  # stop after this many evaluations without a better val loss (0: never)
early_stop_min_delta = 0.0  # an evaluation counts as better only if it lowers the best val loss by this much
max_skipped_steps = 10  # stop after this many updates in a row skipped for a non-finite loss or gradient
# logging
wandb_log = False  # also send metrics to Weights & Biases
wandb_project = "gpt"  # the W&B project the run is logged under
wandb_run_name = "run"  # the run's name in that project
tensorboard_log = False  # also write metrics.jsonl's records as TensorBoard events under out_dir/tb
# data
data_dir = "data/stdlib"  # train.bin, val.bin and meta.json from prepare.py
dataset = ""  # nanoGPT's name for the data: 'NAME' sets data_dir to data/NAME (its folders as they are); the later wins
gradient_accumulation_steps = 1  # micro-steps per update, summed over all processes
batch_size = 12  # sequences per micro-step per process; 'auto': the largest that fits, same update (docs/scaling.md)
batch_size_auto = False  # set by batch_size='auto': batch_size then only counts an update's sequences (with the above)
memory_budget = 0.0  # GiB a process may hold under batch_size='auto' (0: what its device has free)
block_size = 256  # tokens per sequence (from a pretrained folder: at most its max_position_embeddings)
sequences = "windows"  # how training sequences are drawn: data.SEQUENCES says each mode ('windows', 'random', ...)
max_epochs = 0  # also end the run after this many passes over the training split (0: max_iters alone)
# model: every field of GPTConfig (model.py) with a plain default is a setting too (qk_norm, rope_theta, head_size,
# ...), its default there; these are a run's own defaults. From a pretrained folder its config.json sets the shape.
n_layer = 6  # transformer blocks
n_head = 6  # query heads in each block's attention
n_kv_head = 0  # key/value heads for grouped-query attention (0: as many as n_head)
n_embd = 384  # width of the residual stream (the token embedding's)
dropout = 0.0  # 0 for pretraining, try 0.1+ for finetuning
vocab_size = 0  # 0: the dataset's vocabulary, padded up to a multiple of 64
use_kernels = None  # kernels.py's Triton fused ops: True, False, or None (auto: on CUDA with Triton, model.fused),
# and under torch.compile only the fused loss (Inductor fuses the norm's, SwiGLU's and rotary's references itself)
bias = False  # nanoGPT's biases in every linear and norm: this Llama-style block has none (qkv_bias: Qwen2's)
doc_mask = False  # attend only within a document: end-of-text (meta.json's eot_id) begins a new one
# LoRA: train low-rank adapters on a frozen pretrained model (init_from a Hugging Face folder)
lora_rank = 0  # the adapters' rank; 0: off, every weight trains
lora_alpha = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank
lora_dropout = 0.0  # dropout on the adapters' input
lora_targets = "q,k,v,o,gate,up,down"  # projections to adapt; the default is all of them, attention's and the MLP's
lora_base_dtype = "auto"  # the frozen base: 'auto' (the run's dtype), 'float32', 'bfloat16', 'float16', 'nf4' or 'int8'
# (torchao's: 4 bits, or 8 bits weight-only)
# optimizer
optimizer = "adamw"  # optim.OPTIMIZERS says each one ('adamw', 'muon': Muon for the blocks' matrices, ...)
learning_rate = 6e-4  # peak learning rate (under muon: of the AdamW part)
max_iters = 5000  # total optimizer steps
weight_decay = 0.1  # on matrices only (AdamW, Muon: decoupled; Adam, SGD: an L2 term in the gradient)
beta1 = 0.9  # Adam(W)'s
beta2 = 0.95  # Adam(W)'s, for the second moment (beta1 is the first's)
momentum = 0.9  # SGD's
muon_lr = 0.02  # Muon's peak learning rate for the blocks' matrices (the log's lr is learning_rate's, scaled alike)
muon_momentum = 0.95  # Muon's, for the blocks' matrices (momentum is SGD's)
grad_clip = 1.0  # clip gradients at this norm (0: off)
# learning rate schedule: linear warmup over warmup_iters, then lr_schedule, scaling every learning rate (learning_rate,
# muon_lr) by one factor, which the decaying schedules bring to min_lr / learning_rate at lr_decay_iters
decay_lr = True  # False: learning_rate throughout, no warmup and no schedule
lr_schedule = "cosine"  # 'cosine', 'linear', 'polynomial', 'constant' (the peak after warmup), 'wsd', or
# 'cosine_restarts' (cosine to min_lr and back to the peak every lr_cycle_iters, until lr_decay_iters)
warmup_iters = 100  # steps of the linear warmup to the peak, whatever lr_schedule follows
warmup_ratio = 0.0  # if above 0: warm up over this fraction of the run's steps (max_epochs': theirs) for warmup_iters
lr_decay_iters = 5000  # should be ~max_iters
lr_decay_fraction = 0.2  # wsd: stable at the peak, then a linear decay over this last part of lr_decay_iters
min_lr = 6e-5  # ~learning_rate/10
lr_cycle_iters = 1000  # cosine_restarts: steps from one restart to the next
lr_power = 1.0  # polynomial: the decay's power (1: linear)
# system
backend = "auto"  # torch.distributed's: 'nccl', 'gloo', or auto: nccl on CUDA (with gloo under fsdp_cpu_offload)
dist_timeout = 600  # seconds joining the group, or a collective, waits for the others before failing (and restarting)
device = "auto"  # 'auto' (cuda, then mps, then cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
dtype = "auto"  # 'float32', 'bfloat16', 'float16' (with a gradient scaler); auto: bf16 where supported on CUDA
compile = False  # torch.compile the model (slow first step, faster after)
seed = 1337  # sets the initial weights, the data order and dropout
# past one device's memory (docs/scaling.md): shard, split, recompute, offload
fsdp = False  # FSDP2: shard weights, gradients and optimizer state over the data-parallel processes
fsdp_cpu_offload = False  # with fsdp: weights, gradients and optimizer state wait in CPU memory (CUDA only)
tp_size = 1  # tensor parallel over this many processes of a node: attention by heads, the MLP by its width
gradient_checkpointing = False  # keep only each block's input; recompute the rest in the backward pass

# -----------------------------------------------------------------------------
_PLAIN = (int, float, bool, str, type(None))

DTYPES = ("float32", "bfloat16", "float16")  # dtype's choices, beside 'auto'
LORA_BASE_DTYPES = ("auto", *DTYPES, "nf4", "int8")  # lora_base_dtype's choices


def model_settings():
    """GPTConfig's fields that a run can set: those with a plain default (rope_scaling, a dict, comes only
    from a pretrained folder), name -> GPTConfig's default."""
    return {f.name: f.default for f in _dataclasses.fields(_GPTConfig)
            if isinstance(f.default, _PLAIN) and f.default is not None or f.name in globals()}


def defaults():
    """Every setting -> its default: the model's (GPTConfig's fields), then this module's own."""
    own = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, _PLAIN)}
    return {**model_settings(), **own}


# train.py's numbers that have a range, checked in this order: each must be at least its low and below its high (a
# negative max_iters would train nothing and save nothing)
_IN_RANGE = {**dict.fromkeys(("eval_interval", "log_interval", "eval_iters", "batch_size", "block_size",
                              "gradient_accumulation_steps", "max_skipped_steps", "dist_timeout", "tp_size"),
                             (1, _math.inf)),
             **dict.fromkeys(("max_iters", "warmup_iters", "lr_decay_iters", "keep_last_n", "early_stop_patience",
                              "lora_rank", "eval_tasks_limit", "learning_rate", "min_lr", "muon_lr", "weight_decay",
                              "grad_clip", "early_stop_min_delta", "max_epochs", "memory_budget"), (0, _math.inf)),
             **dict.fromkeys(("warmup_ratio", "beta1", "beta2", "momentum", "muon_momentum", "dropout", "lora_dropout"),
                             (0, 1)),
             "seed": (0, 2**63), "lora_alpha": (0, _math.inf)}


# The numbers sample.py and eval.py take, checked as a run's are (check_ranges): name -> (low, high), and "at most"
# where high itself is allowed
SAMPLING = {"temperature": (0, _math.inf), "top_p": (0, 1, "at most"), "top_k": (0, _math.inf),
            "num_samples": (1, _math.inf), "max_new_tokens": (1, _math.inf), "seed": (0, 2**63)}
EVALUATION = {"batch_size": (1, _math.inf), "block_size": (1, _math.inf), "stride": (0, _math.inf),
              "limit": (0, _math.inf), "num_fewshot": (0, _math.inf)}


def check_ranges(values, ranges, flag=""):
    """UserError in one line for the first of values (name -> number; None: not given) outside its range in ranges
    (name -> (low, high[, "at most"])); NaN is outside every range. flag: '--' for a command-line flag."""
    for key, (low, high, *at_most) in ranges.items():
        value = values.get(key)
        if value is not None and not (low <= value <= high if at_most else low <= value < high):
            above = ((" and finite" if value == _math.inf else "") if high == _math.inf
                     else f" and {'at most' if at_most else 'below'} {high}")
            raise _UserError(f"{flag}{key}={value} must be at least {low}{above}")


# settings that play a part only where others have some values: name -> ((that setting, those values), ...), the
# first one out noted (warmup_ratio above 0 replaces warmup_iters; 'constant' never decays to min_lr; examples are
# scored one by one; doc_mask under examples, which attend within themselves anyway, is sample.py's still)
_DECAYING = ("lr_schedule", tuple(s for s in _optim.SCHEDULES if s != "constant"))
_WINDOWS = ("sequences", tuple(name for name, mode in _data.SEQUENCES.items() if not mode.examples))
_PLAYS_UNDER = {**dict.fromkeys(("lr_schedule", "warmup_ratio"), (("decay_lr", (True,)),)),
                "warmup_iters": (("decay_lr", (True,)), ("warmup_ratio", (0.0,))),
                **dict.fromkeys(("lr_decay_iters", "min_lr"), (("decay_lr", (True,)), _DECAYING)),
                **{knob: (("decay_lr", (True,)), ("lr_schedule", (schedule,))) for knob, schedule in
                   (("lr_power", "polynomial"), ("lr_decay_fraction", "wsd"), ("lr_cycle_iters", "cosine_restarts"))},
                "eval_stride": (_WINDOWS, ("eval_full", (True,))), "eval_full": (_WINDOWS,),
                **dict.fromkeys(("wandb_project", "wandb_run_name"), (("wandb_log", (True,)),)),
                "memory_budget": (("batch_size_auto", (True,)),)}


def unused(config):
    """Notes (lines to print) for the settings of config given a value of their own that its other settings leave
    out of play, as a config file's may be once a flag changes what they belong to."""
    def said(key, value):  # as a user gives it: batch_size_auto=True is batch_size='auto'
        if key == "batch_size_auto":
            return f"batch_size={'auto' if value else config['batch_size']!r}"
        return f"{key}={value!r}"

    def out_of_play(name, setting_of, runs):
        return (f"note: {name}={config[name]!r} plays no part in this run: it is a setting of {setting_of}, and the "
                f"run's is {runs}")
    default = defaults()
    # one evaluation, as nanoGPT's: a training config's settings of training, saving and logging are all left out
    notes = ["note: eval_only=True evaluates once and exits, writing nothing: the settings of training, checkpoints "
             "and logging play no part"] if config["eval_only"] else []
    for name, conditions in _PLAYS_UNDER.items():
        out = next(((u, v) for u, v in conditions if config[u] not in v), None)  # the first that leaves it out
        if out and config[name] != default[name]:
            under, values = out
            notes.append(out_of_play(name, said(under, values[0]), said(under, config[under])))
    notes += [out_of_play(name, "eval_tasks", "eval_tasks=''") for name in ("eval_tasks_limit", "eval_tasks_path")
              if not config["eval_tasks"] and config[name] != default[name]]
    if config["optimizer"] in _optim.OPTIMIZERS:  # (else refused when built) another optimizer's own settings
        read = {name: _optim.settings_read(name, config) for name in _optim.OPTIMIZERS}
        notes += [f"note: {name}={config[name]!r} plays no part in this run: optimizer={config['optimizer']!r} "
                  f"does not read it" for name in sorted(set().union(*read.values()) - read[config["optimizer"]])
                  if config[name] != default[name]]
    return notes


def check(config):
    """UserError, in one line with the fix, for a setting (config, every one of them) that no run can use; the
    optimizer's and the schedule's are optim.check_optimizer's, the sequences' data.check_sequences'."""
    check_ranges(config, _IN_RANGE)  # else a traceback from torch's first step, or nonsense trained
    if config["lora_rank"] and config["lora_alpha"] == 0:  # the adapters' output times 0: nothing would train
        raise _UserError("lora_alpha=0 scales the adapters' output to nothing: set it above 0 (16 is usual)")
    lora = [k for k in ("lora_alpha", "lora_dropout", "lora_targets", "lora_base_dtype") if config[k] != defaults()[k]]
    if lora and not config["lora_rank"]:  # (a LoRA run resumes with its lora_rank given again)
        raise _UserError(f"{lora[0]}={config[lora[0]]!r} is a setting of LoRA's adapters, and lora_rank=0 trains "
                         f"none: set lora_rank (8 or 16 is usual), or leave {lora[0]} out")
    for flag, module, name, package in (("tensorboard_log", "torch.utils.tensorboard", "TensorBoard", "tensorboard"),
                                        ("wandb_log", "wandb", "Weights & Biases", "wandb")):
        if config[flag]:  # what metrics.py logs with: found out now, not at the first record
            try:
                _importlib.import_module(module)
            except ImportError:
                raise _UserError(f"{flag}=True needs {name}: pip install {package}") from None
    if config["bias"]:  # a nanoGPT config file's bias=True
        raise _UserError("bias=True: this model's blocks are Llama's, with no biases in their linears and norms "
                         "(nanoGPT's GPT-2 blocks have them); leave bias out, or set qkv_bias=True for Qwen2's")
    if not any(config["use_kernels"] is allowed for allowed in (None, True, False)):  # (1 == True, 0.0 == False)
        raise _UserError(f"use_kernels={config['use_kernels']!r} must be True, False or None (auto)")
    if config["eval_full"] and config["eval_stride"] != -1 and not 0 <= config["eval_stride"] < config["block_size"]:
        raise _UserError(f"eval_stride={config['eval_stride']} must be at least 0 and below block_size="
                         f"{config['block_size']} (the windows' overlap)")
    if config["eval_tasks"] and (config["fsdp"] or config["tp_size"] > 1):
        raise _UserError("eval_tasks runs on the master process alone, which holds the whole model only without "
                         "fsdp and tp_size")
    if config["family"] != "llama":  # the Hugging Face model type the weights are named and exported as
        from lib.hf import HF_ARCHITECTURES
        if config["family"] not in HF_ARCHITECTURES:
            raise _UserError(f"family={config['family']!r} is not one of {', '.join(map(repr, HF_ARCHITECTURES))}")
    if config["lora_base_dtype"] not in LORA_BASE_DTYPES:
        raise _UserError(f"lora_base_dtype={config['lora_base_dtype']!r} is not one of {', '.join(LORA_BASE_DTYPES)}")
    _data.check_sequences(config["sequences"])
    _optim.check_optimizer(config)


# A model's sizes, from whatever says them (settings, a checkpoint, a config.json): positions past every released
# model's (Qwen2.5-1M has ~1M), few enough that the rotary tables are not themselves the hostile input
_MAX_POSITIONS = 1 << 21
_MAX_TABLE = _MAX_POSITIONS * 256  # positions x head size: 2M positions of heads 256 wide (2 GiB of fp32 tables)
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")  # rope_scaling


def check_sizes(args, where, fix, names=None):
    """UserError in one line, naming where (the file that says them) and fix, unless every model size in args is a
    whole number above 0 (0 where derived), block_size within limits, rope_theta, norm_eps and dropout in range, and
    rope_scaling (if any) llama3's numbers. names: each setting's own name in where (config.json's), if another."""
    said = (names or {}).get
    for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "head_size", "mlp_hidden"):
        value, low = args.get(name, 1), 0 if name in ("n_kv_head", "head_size", "mlp_hidden") else 1  # 0: derived
        if type(value) is not int or value < low:  # (from the other sizes, by GPTConfig)
            raise _UserError(f"{where} says {said(name, name)}={value!r}, not a whole number "
                             f"{'of at least 0' if low == 0 else 'above 0'}: {fix}")
    if args.get("block_size", 1) > _MAX_POSITIONS:
        raise _UserError(f"{where} says {said('block_size', 'block_size')}={args['block_size']}, past the "
                         f"{_MAX_POSITIONS} positions this model.py holds tables for: {fix}")
    head = args.get("head_size") or args.get("n_embd", 1) // max(args.get("n_head", 1), 1)
    if args.get("block_size", 1) * head > _MAX_TABLE:  # the rotary tables' cos and sin, each positions x head / 2
        raise _UserError(f"{where} says {said('block_size', 'block_size')}={args['block_size']} positions of heads "
                         f"{head} wide: rotary tables of {args['block_size'] * head * 4 / 2**30:.0f} GiB, past every "
                         f"released model's: {fix}")
    # rope_theta above 1 and llama3's factor at least 1: every rotary frequency at most 1, and finite in float32 (1e-300
    # is above 0, and 0 there: every loss NaN)
    for name, low, high in (("rope_theta", 1, 1e300), ("norm_eps", 0, 1), ("dropout", -1e-9, 1)):
        value = args.get(name, low + 0.5)  # (absent: passes; an int past 1e300 would be past a float's range)
        if type(value) not in (int, float) or not low < value < high:
            raise _UserError(f"{where} says {said(name, name)}={value!r}, not a number in its range: {fix}")
    scaling = args.get("rope_scaling")
    if scaling is not None:
        values = [scaling.get(k) for k in LLAMA3_SCALING] if isinstance(scaling, dict) else [None] * 4
        # (the high frequency factor above the low one: rotary_tables' ramp divides by their difference)
        if not all(type(v) in (int, float) and 0 < v < 1e300 for v in values) or values[2] <= values[1] \
                or values[0] < 1:
            raise _UserError(f"{where} says rope_scaling {scaling!r}: it must hold numbers above 0 for "
                             f"{', '.join(LLAMA3_SCALING)}, high_freq_factor above low_freq_factor, factor at least 1: "
                             f"{fix}")
