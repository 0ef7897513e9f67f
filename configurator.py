"""
Overrides for a run's settings (lib/settings.py), from config files and --key=value arguments, in the order given:

    python train.py config/train_small.py --batch_size=32 --compile=False

A config file is Python whose top-level assignments replace the defaults where they run (names starting with _,
modules, functions and classes are its own helpers); a line that sets nothing (YAML's key: value, a JSON object) is
refused. A --key=value is read with ast.literal_eval, else as a string. Every key must exist and every value have its
default's type (an int does for a float), or one line names the closest key or the expected type.
batch_size='auto' sets batch_size_auto, batch_size keeping its number (times gradient_accumulation_steps: an update's
sequences, which train.py keeps). dataset='NAME' (nanoGPT's) sets data_dir to data/NAME; of the two, the later wins.
"""

import ast
import collections.abc
import difflib
import dis
import os
import re
import sys
import traceback
import types

_HELPERS = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, type)  # a config file's own names


def _globals_set(code):
    # the names a config file's functions or classes declare global and set, in order (whether or not they run: a
    # function that sets a setting to the value it had counts, batch_size = 8 after 'auto')
    names = [i.argval for i in dis.get_instructions(code) if i.opname == "STORE_GLOBAL"]
    return names + [n for c in code.co_consts if isinstance(c, types.CodeType) for n in _globals_set(c)]


class _Stores(collections.abc.MutableMapping):
    """A config file's top-level names as it runs (its locals()): scope itself (which its functions read as their
    globals), each store noted in set, in order; so an assignment counts where it ran, not where it stands."""
    def __init__(self, scope):
        self.scope, self.set = scope, []

    def __setitem__(self, key, value):
        self.set.append(key)
        self.scope[key] = value

    def __getitem__(self, key):
        return self.scope[key]

    def __delitem__(self, key):
        del self.scope[key]

    def __iter__(self):
        return iter(self.scope)

    def __len__(self):
        return len(self.scope)


def configure(config, args):
    """Apply the config files and --key=value overrides in args to the dict config, in place."""
    kinds = dict(config)  # each key takes its value's type as given (the defaults': None for any)
    for arg in args:
        if arg in ("-h", "--help"):
            print(f"usage: python {os.path.basename(sys.argv[0])} [CONFIG_FILE ...] [--key=value ...]: every setting, "
                  f"its default and what it does, is in lib/settings.py (docs/configs.md)")
            sys.exit(0)
        if not arg.startswith("--"):
            try:
                with open(arg, encoding="utf-8-sig") as f:  # (a BOM, as some Windows editors write, is no code)
                    code = f.read()
            except OSError as e:
                dashes = f"; a setting is --{arg.lstrip('-')}" if "=" in arg and not os.path.exists(arg) else ""
                sys.exit(f"config file {arg}: {e.strerror} (give a path like config/train_small.py{dashes})")
            except UnicodeDecodeError:
                sys.exit(f"config file {arg}: not UTF-8 text (save it as UTF-8)")
            scope, before = dict(config), dict(config)  # what the file reads: the settings so far
            try:
                tree = ast.parse(code, arg)
                for node in tree.body:  # YAML's key: value and a JSON object are Python too, setting nothing
                    if (isinstance(node, ast.AnnAssign) and node.value is None or isinstance(node, ast.Expr)
                            and not isinstance(node.value, (ast.Call, ast.Constant, ast.NamedExpr))):
                        said = re.split(r"\r\n|\r|\n", code)[node.lineno - 1]  # Python's lines (not \f's, \x85's)
                        sys.exit(f"config file {arg}, line {node.lineno}: {said!r} sets nothing; a config file is "
                                 f"Python: write key = value")
                compiled, stores = compile(tree, arg, "exec"), _Stores(scope)
                exec(compiled, scope, stores)
            except Exception as e:  # a mistake in the user's file: name it, no traceback
                frames = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == arg]
                line = e.lineno if isinstance(e, SyntaxError) else frames[-1] if frames else None
                said = {"true": "True", "false": "False", "none": "None", "null": "None"}.get(getattr(e, "name", ""))
                fix = f" (Python's is {said})" if said else " (a text is quoted: key = 'value')" \
                    if isinstance(e, NameError) else ""
                sys.exit(f"config file {arg}{f', line {line}' if line else ''}: {type(e).__name__}: {e}{fix}")
            # what it set, each to its last value (one it deleted: none), in the order of their last stores: the
            # names its top level stored (one set to the value it had counts: batch_size = 12 after 'auto'), those
            # its functions declare global, and any other it changed (through globals())
            changed = [k for k, v in scope.items() if k != "__builtins__" and before.get(k, scope) is not v]
            stored = list(dict.fromkeys(reversed(stores.set)))[::-1]
            for key in dict.fromkeys([*stored, *_globals_set(compiled), *changed]):
                if key in scope and not (key.startswith("_") or isinstance(scope[key], _HELPERS)):
                    _set(config, key, scope[key], arg, kinds)
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
            _set(config, key, value, arg, kinds)


def _set(config, key, value, source, kinds):
    if key == "batch_size" and "batch_size_auto" in config:  # 'auto', or a number that turns 'auto' off
        config["batch_size_auto"] = value == "auto"
        if value == "auto":
            return
    if key not in config:
        close = difflib.get_close_matches(key, config, n=1)
        own = "" if source.startswith("--") else "; a name of the file's own begins with _"  # (a helper of its)
        hint = f"did you mean '{close[0]}'?" if close else f"see lib/settings.py{own}"
        if key == "config" and source.startswith("--"):  # (other trainers' flag)
            hint = f"a config file is given as it is: python {os.path.basename(sys.argv[0])} {value}"
        sys.exit(f"{source}: unknown config key '{key}' ({hint})")
    if key == "init_from" and value == "auto" and config[key] not in ("scratch", "resume", "auto"):
        return  # a folder resumes out_dir's run begun from it, as 'auto' would (slurm.sbatch adds it to a fine-tune)
    default = kinds.get(key, config[key])
    if type(default) is float and type(value) is int and abs(value) < 2**1024:  # (past it: no float)
        value = float(value)
    elif default is not None and type(value) is not type(default):
        also = " or 'auto'" if key == "batch_size" and "batch_size_auto" in config else ""  # ('auto' is lower case)
        sys.exit(f"{source}: {key} must be {type(default).__name__} like {config[key]!r}{also}, got {value!r}")
    if isinstance(value, str) and value.split("/")[0] == "~":  # a config file's "~/runs" (or ~): the home folder
        value = os.path.expanduser(value)
    config[key] = value
    if key == "dataset" and value and "data_dir" in config:  # nanoGPT's name for data/NAME
        config["data_dir"] = os.path.join("data", value)
