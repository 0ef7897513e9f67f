"""
Overrides for train.py's globals, from config files and --key=value arguments, in the order given:

    python train.py config/train_small.py --batch_size=32 --compile=False

A config file is Python whose top-level assignments replace the defaults (names that start with
an underscore, modules and functions are its own helpers and are left alone). A --key=value is
read with ast.literal_eval, falling back to a plain string. Every key must already exist, and every
value must have its default's type (an int where a float is expected is fine): anything else stops
with one line that names the closest key or the expected type. batch_size='auto' is the one value of another
type: it sets batch_size_auto and leaves batch_size the number it was (with gradient_accumulation_steps, the
sequences of an update, which train.py keeps). check_settings then refuses values that no
run can use, in one line.
"""

import ast
import difflib
import math
import sys
import traceback
import types

from lib.errors import UserError

# train.py's numbers that have a range: each must be at least its low and below its high
IN_RANGE = {"learning_rate": (0, math.inf), "min_lr": (0, math.inf), "muon_lr": (0, math.inf),
            "weight_decay": (0, math.inf), "grad_clip": (0, math.inf), "early_stop_min_delta": (0, math.inf),
            "beta1": (0, 1), "beta2": (0, 1), "momentum": (0, 1), "muon_momentum": (0, 1), "dropout": (0, 1),
            "seed": (0, 2**63)}
AT_LEAST_ONE = ("eval_interval", "log_interval", "eval_iters", "batch_size", "block_size",
                "gradient_accumulation_steps", "max_skipped_steps", "dist_timeout")


def _check(config, key, value, source):
    if key not in config:
        close = difflib.get_close_matches(key, config, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "see the globals at the top of train.py"
        sys.exit(f"{source}: unknown config key '{key}' ({hint})")
    default = config[key]
    if default is None or type(value) is type(default):
        return value
    if type(default) is float and type(value) is int:
        return float(value)
    sys.exit(f"{source}: {key} must be {type(default).__name__} like its default {default!r}, got {value!r}")


def configure(config, args):
    """Apply the config files and --key=value overrides in args to the dict config, in place."""
    for arg in args:
        if not arg.startswith("--"):
            try:
                with open(arg) as f:
                    code = f.read()
            except OSError as e:
                sys.exit(f"config file {arg}: {e.strerror} (give a path like config/train_small.py)")
            scope, before = dict(config), dict(config)  # (before: batch_size='auto' changes batch_size_auto)
            try:
                exec(compile(code, arg, "exec"), scope)
            except Exception as e:  # a mistake in the user's file: name it, no traceback
                frames = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
                line = e.lineno if isinstance(e, SyntaxError) else frames[-1]
                sys.exit(f"config file {arg}, line {line}: {type(e).__name__}: {e}")
            for key, value in scope.items():
                helper = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)
                own = key.startswith("_") or isinstance(value, helper)
                if not own and (key not in before or value is not before[key]):
                    _set(config, key, value, arg)
        else:
            key, eq, text = arg[2:].partition("=")
            if not eq:
                sys.exit(f"argument {arg}: write overrides as --key=value")
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = {"true": True, "false": False}.get(text.lower(), text)  # a bare string
            if isinstance(config.get(key), str) and not isinstance(value, str):
                value = text  # --out_dir=123 means the string '123'
            _set(config, key, value, arg)


def _set(config, key, value, source):
    if key == "batch_size" and "batch_size_auto" in config:  # 'auto', or a number that turns 'auto' off
        config["batch_size_auto"] = value == "auto"
        if value == "auto":
            return
    config[key] = _check(config, key, value, source)


def check_settings(config):
    """UserError, in one line with the fix, for a setting of train.py's (config) that no run can use (the
    optimizer's and the schedule's: optim.check_optimizer)."""
    for key in AT_LEAST_ONE:
        if config[key] < 1:
            raise UserError(f"{key}={config[key]} must be at least 1")
    for key, (low, high) in IN_RANGE.items():  # else a traceback from torch's first step, or nonsense trained
        if key in config and not low <= config[key] < high:
            within = f"at least {low}" if high == math.inf else f"at least {low} and below {high}"
            raise UserError(f"{key}={config[key]} must be {within}")
    if config.get("memory_budget", 0) < 0:
        raise UserError(f"memory_budget={config['memory_budget']} must be at least 0 (GiB; 0: what the device has "
                        f"free)")
    if config["tensorboard_log"]:  # found out now, not at the first record
        try:
            import torch.utils.tensorboard  # noqa: F401 (metrics.py writes with it)
        except ImportError:
            raise UserError("tensorboard_log=True needs TensorBoard: pip install tensorboard") from None
    if config["use_kernels"] not in (None, True, False):
        raise UserError(f"use_kernels={config['use_kernels']!r} must be True, False or None (auto)")
    if config["eval_full"] and not 0 <= config["eval_stride"] < config["block_size"]:
        raise UserError(f"eval_stride={config['eval_stride']} must be at least 0 and below block_size="
                        f"{config['block_size']} (the windows' overlap)")
    if config["sequences"] not in ("windows", "random", "examples"):
        raise UserError(f"sequences={config['sequences']!r} is not 'windows', 'random' or 'examples'")
    if config["eval_tasks"] and (config["fsdp"] or config["tp_size"] > 1):
        raise UserError("eval_tasks runs on the master process alone, which holds the whole model only without fsdp "
                        "and tp_size")
    if config["max_epochs"] < 0 or not 0 <= config["warmup_ratio"] < 1:
        raise UserError(f"max_epochs={config['max_epochs']} must be at least 0 and warmup_ratio="
                        f"{config['warmup_ratio']} in [0, 1)")
