"""
Bounds on what comes from disk: a checkpoint, a dataset or a model folder is data, and data may lie. A model's
sizes are checked to be whole numbers and then against its weights' own shapes before anything is allocated, and
a file that a folder's index names is read only when it is a regular file inside that folder. A tokenizer.json's
normalizer and pre-tokenizer are checked to grow a text within a bound and to hold no regex that backtracks without one.

    from lib.bounds import check_sizes, confined
    check_sizes({"n_layer": 2, "n_embd": 64}, "out/ckpt.pt", "use another checkpoint")
    confined("data/mine", "tokenizer.json", "data/mine/meta.json")    # Path, or a one-line UserError
"""

import base64
import math
import os
import re
import stat
from pathlib import Path

import numpy as np

from lib.errors import UserError

# The most positions a model may hold rotary tables for: past every released model (Qwen2.5-1M has ~1M), and
# small enough that the tables (positions x head size, twice) are not themselves the hostile input.
MAX_POSITIONS = 1 << 21
MAX_TABLE = MAX_POSITIONS * 256  # positions x head size: 2M positions of heads 256 wide (2 GiB of fp32 tables)
SIZES = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "head_size", "mlp_hidden")
DERIVED = ("n_kv_head", "head_size", "mlp_hidden")  # 0 means "from the other sizes" (GPTConfig)


def check_sizes(args, where, fix):
    """UserError in one line unless every model size in args (GPTConfig's names) is a whole number above 0 (0
    allowed where it means derived), block_size at most MAX_POSITIONS, and rope_theta, norm_eps and dropout are
    numbers in their range. where: the file that says them; fix: what to do about it."""
    for name in SIZES:
        value = args.get(name, 1)
        if type(value) is not int or value < (0 if name in DERIVED else 1):
            raise UserError(f"{where} says {name}={value!r}, not a whole number above 0: {fix}")
    if args.get("block_size", 1) > MAX_POSITIONS:
        raise UserError(f"{where} says block_size={args['block_size']}, past the {MAX_POSITIONS} positions this "
                         f"model.py holds tables for: {fix}")
    head = args.get("head_size") or args.get("n_embd", 1) // max(args.get("n_head", 1), 1)
    if args.get("block_size", 1) * head > MAX_TABLE:  # the rotary tables' cos and sin, each positions x head / 2
        raise UserError(f"{where} says block_size={args['block_size']} positions of heads {head} wide: rotary tables "
                        f"of {args['block_size'] * head * 4 / 2**30:.0f} GiB, past every released model's: {fix}")
    for name, low, high in (("rope_theta", 0, math.inf), ("norm_eps", 0, 1), ("dropout", -1e-9, 1)):
        value = args.get(name, 0.5)
        if type(value) not in (int, float) or not low < value < high:
            raise UserError(f"{where} says {name}={value!r}, not a number in its range: {fix}")


def layer_count(names, prefix):
    """How many blocks a set of weight names holds: the distinct N of the names that begin with prefix + 'N.'."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({m.group(1) for m in map(pattern.match, names) if m})


def check_shapes(model, shapes, names, where, fix):
    """UserError in one line at the first tensor of shapes ({its name: shape}, read from a file's headers or
    its tensors) whose shape differs from the parameter that names ({its name: our parameter's}) maps it to, in
    model (built on the meta device, so that a lie costs no memory)."""
    params = dict(model.named_parameters())
    for theirs, ours in names.items():
        if theirs in shapes and ours in params and tuple(shapes[theirs]) != tuple(params[ours].shape):
            raise UserError(f"{theirs} in {where} has shape {tuple(shapes[theirs])}, but the sizes it states "
                             f"imply {tuple(params[ours].shape)}: {fix}")


def confined(folder, name, where):
    """folder/name, where name is a relative path that stays inside folder (links resolved) and, if it is
    there, a regular file (not a FIFO or a device, which would hang or never end); else a one-line UserError
    saying that where (the file that named it) names it."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise UserError(f"{where} names {name!r}, not a file inside {folder}: replace it with the folder's own")
    root, real = os.path.realpath(folder), os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([root, real]) != root:
        raise UserError(f"{where} names {name!r}, which is outside {folder}: replace it with the folder's own")
    if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):
        raise UserError(f"{where} names {name!r}, which is not a regular file: replace it with the folder's own")
    return Path(folder) / name


def check_regular(path, fix):
    """UserError in one line where path is there but is not a regular file: a FIFO would hang its read, a device
    (/dev/zero) never end it."""
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        raise UserError(f"{path} is not a regular file (a FIFO, a device or a folder): {fix}")


def check_token_ids(path, dtype, vocab_size, chunk=1 << 24):
    """UserError in one line unless path, a token file of dtype, is a file whose every id is below vocab_size
    (meta.json's: an id past it but under the model's padded vocabulary would train a row no text has). It is
    read in chunks of memory-mapped ids, about as fast as the disk reads."""
    if not os.path.isfile(path):
        raise UserError(f"{path} is not a file: prepare the data again (python prepare.py ...)")
    ids = np.memmap(path, dtype=dtype, mode="r") if os.path.getsize(path) else np.zeros(0, dtype)
    for start in range(0, len(ids), chunk):
        piece = ids[start:start + chunk]
        if int(piece.max()) >= vocab_size:
            at = int(np.argmax(piece >= vocab_size))  # the first one, to name where the file goes wrong
            raise UserError(f"{path} holds token id {int(piece[at])} at position {start + at}, past meta.json's "
                             f"vocab_size {vocab_size}: it is not the data meta.json describes (prepare it again)")

# -----------------------------------------------------------------------------
# a tokenizer.json's own rules: its normalizer and pre-tokenizer, which the tokenizers library runs as written

# How many characters one character may become through a tokenizer's normalizer and pre-tokenizer, all their rules
# in turn, at most: released tokenizers stay under ~80 by the count below (XLM-R's 72). A Replace of " " by 20,000
# characters asked for 2 GB on 48 KB of text, and the tokenizers library aborted the process.
MAX_GROWTH = 100
# Unicode's normalizations grow a character at most this much (NFKC's worst, U+FDFA, is 18), and what one leaves is
# normalized already: in a row they grow a text as much as the worst of them, not their product.
UNICODE = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 3, "BertNormalizer": 18}
REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|\(\?>|[()*+]|\{\d*,?\d*\}|.", re.S)


def leaf_rules(rule):
    # the rules of a normalizer or pre-tokenizer, Sequences opened
    parts = rule.get("normalizers") or rule.get("pretokenizers") if isinstance(rule, dict) else None
    if isinstance(parts, list):
        return [leaf for part in parts for leaf in leaf_rules(part)]
    return [rule] if isinstance(rule, dict) else []


def rule_growth(rule):
    """How many characters one may become through one rule of a normalizer or pre-tokenizer, at most."""
    kind = rule.get("type")
    if kind == "Replace":  # a regex may match nothing, so that each place gets the whole content
        pattern, content = rule.get("pattern") or {}, str(rule.get("content", ""))
        plain = str(pattern.get("String", "")) if isinstance(pattern, dict) else ""
        return max(1, len(content) / len(plain)) if plain else 1 + len(content)
    if kind == "Prepend":
        return 1 + len(str(rule.get("prepend", "")))
    if kind == "Precompiled":  # its replacements follow its trie (whose size is first, 4 bytes), each ends in NUL
        blob = base64.b64decode(rule.get("precompiled_charsmap") or "")
        strings = blob[4 + int.from_bytes(blob[:4], "little"):].split(b"\0")
        return max(1, *(len(s.decode("utf-8", "replace")) for s in strings))
    return UNICODE.get(kind) or {"ByteLevel": 4, "Metaspace": 2}.get(kind, 1)


def tokenizer_growth(steps):
    """-> (how many characters one may become through steps, a normalizer and a pre-tokenizer; the kind of rule
    that grows it most). A table of Unicode's (Precompiled) that grows no more than Unicode does counts as one."""
    growths = [(rule_growth(leaf), leaf.get("type")) for step in steps for leaf in leaf_rules(step)]
    like_unicode = [kind in UNICODE or (kind == "Precompiled" and g <= 18) for g, kind in growths]
    growth = max([g for (g, _), alike in zip(growths, like_unicode) if alike], default=1)
    for (g, _), alike in zip(growths, like_unicode):
        growth *= 1 if alike else g
    return growth, max(growths, key=lambda each: each[0], default=(1, None))[1]


def nested_repeat(pattern):
    """Whether a regex repeats a group that holds a repeat or alternatives ((a+)+b, (a|aa)+b): where the text does
    not match, Oniguruma tries every way to share a run among them, exponential in its length. An atomic group
    (?>...) gives nothing back, and is left alone. No released tokenizer repeats a group."""
    holds, atomic, closed = [False], [False], False  # per open group: whether it holds a repeat, is atomic
    for token in REGEX_TOKEN.findall(pattern):
        if token in ("(", "(?>"):
            holds.append(False)
            atomic.append(token == "(?>")
            closed = False
        elif token == ")" and len(holds) > 1:
            inner = holds.pop() and not atomic.pop()
            holds[-1] = holds[-1] or inner
            closed = inner
        elif token == "|":
            holds[-1] = True
            closed = False
        elif token in "*+" or (token[0] == "{" and re.search(r"[2-9]|\d\d|,\}|,$", token[1:-1])):
            if closed:
                return True
            holds[-1] = True
        else:
            closed = False
    return False


def check_tokenizer_rules(name, rules):
    """UserError in one line unless the normalizer and pre-tokenizer of rules (a tokenizer.json's content) grow a
    text at most MAX_GROWTH times and hold no regex that repeats a repeated group (nested_repeat)."""
    if not isinstance(rules, dict):
        raise UserError(f"{name} is not a tokenizer.json (no JSON object): use the model's own")
    steps = [rules.get("normalizer"), rules.get("pre_tokenizer")]
    growth, worst = tokenizer_growth(steps)
    if growth > MAX_GROWTH:
        raise UserError(f"{name}'s normalizer and pre-tokenizer may make one character into {growth:,.0f} (its "
                        f"{worst} rule), past the {MAX_GROWTH} any released tokenizer needs: use the model's own "
                        f"tokenizer.json")
    stack = steps
    while stack:  # every regex of the two, however deep in Sequences
        rule = stack.pop()
        if isinstance(rule, (list, dict)):
            stack.extend(rule.values() if isinstance(rule, dict) else rule)
        if isinstance(rule, dict) and isinstance(rule.get("Regex"), str) and nested_repeat(rule["Regex"]):
            raise UserError(f"{name} splits or replaces with the regex {rule['Regex'][:80]!r}, which repeats a "
                            f"group of repeats or alternatives and can take time without bound: use the model's own "
                            f"tokenizer.json")
