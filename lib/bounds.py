"""
Bounds on what comes from disk that only some runs read: a file a folder's index names is read only if it is a regular
file inside that folder; a tokenizer.json's normalizer and pre-tokenizer must grow a text within a bound and hold no
regex that backtracks without one; weights must have the shapes their stated sizes imply (check_shapes,
layer_count). (Elsewhere: settings.check_sizes, files.check_token_ids.)

    from lib.bounds import confined
    confined("data/mine", "tokenizer.json", "data/mine/meta.json")    # Path, or a one-line UserError
"""

import base64
import os
import re
import stat
from pathlib import Path

from lib.files import UserError


def confined(folder, name, where):
    """folder/name, where name is a relative path inside folder (links resolved) that, if there, is a regular file (a
    FIFO or a device would hang or never end); else a one-line UserError, where being the file that names it."""
    if not isinstance(name, str) or not name or os.path.isabs(name):
        raise UserError(f"{where} names {name!r}, not a file inside {folder}: replace it with the folder's own")
    root, real = os.path.realpath(folder), os.path.realpath(os.path.join(folder, name))
    # a Hugging Face cache's snapshot (hub/models--ORG--NAME/snapshots/REVISION) links its files to the repo's blobs
    blobs = os.path.join(os.path.dirname(os.path.dirname(root)), "blobs")
    if os.path.basename(os.path.dirname(root)) == "snapshots" and os.path.commonpath([blobs, real]) == blobs:
        root = blobs
    if os.path.commonpath([root, real]) != root:
        raise UserError(f"{where} names {name!r}, which is outside {folder}: replace it with the folder's own")
    if os.path.exists(real) and not stat.S_ISREG(os.stat(real).st_mode):
        raise UserError(f"{where} names {name!r}, which is not a regular file: replace it with the folder's own")
    return Path(folder) / name


# -----------------------------------------------------------------------------
# a tokenizer.json's normalizer and pre-tokenizer, which the tokenizers library runs as written

# How many characters one may become through all their rules, at most: released tokenizers stay under ~80 by the count
# below (XLM-R's 72). A Replace of " " by 20,000 characters asked for 2 GB on 48 KB of text, and the library aborted.
MAX_GROWTH = 100
# Unicode's normalizations grow a character at most this much (NFKC's worst, U+FDFA, is 18), and what one leaves is
# normalized already: in a row they grow a text as much as the worst of them, not their product.
UNICODE = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 3, "BertNormalizer": 18}
REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|\(\?>|[()*+]|\{\d*,?\d*\}|.", re.S)


def leaf_rules(rule):
    # the rules of a normalizer, pre-tokenizer or decoder, Sequences opened
    parts = rule.get("normalizers") or rule.get("pretokenizers") or rule.get("decoders") if isinstance(rule, dict) \
        else None
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
        after_group, closed = closed, False  # whether the token before closed a group that holds a repeat
        if token in ("(", "(?>"):
            holds.append(False)
            atomic.append(token == "(?>")
        elif token == ")" and len(holds) > 1:
            inner = holds.pop() and not atomic.pop()
            holds[-1] = holds[-1] or inner
            closed = inner
        elif token == "|":
            holds[-1] = True
        elif token in "*+" or (token[0] == "{" and re.search(r"[2-9]|\d\d|,\}|,$", token[1:-1])):
            if after_group:
                return True
            holds[-1] = True
    return False


def check_tokenizer_rules(name, rules):
    """UserError unless the normalizer and pre-tokenizer of rules (a tokenizer.json's content) grow a text at most
    MAX_GROWTH times, its decoder (on its own: it reads the tokens' text) too, and no regex is a nested_repeat."""
    if not isinstance(rules, dict):
        raise UserError(f"{name} is not a tokenizer.json (no JSON object): use the model's own")
    steps = [rules.get("normalizer"), rules.get("pre_tokenizer")]
    for part, rule_steps in (("normalizer and pre-tokenizer", steps), ("decoder", [rules.get("decoder")])):
        growth, worst = tokenizer_growth(rule_steps)
        if growth > MAX_GROWTH:
            raise UserError(f"{name}'s {part} may make one character into {growth:,.0f} (its {worst} rule), past the "
                            f"{MAX_GROWTH} any released tokenizer needs: use the model's own tokenizer.json")
    stack = steps
    while stack:  # every regex of the two, however deep in Sequences
        rule = stack.pop()
        if isinstance(rule, (list, dict)):
            stack.extend(rule.values() if isinstance(rule, dict) else rule)
        if isinstance(rule, dict) and isinstance(rule.get("Regex"), str) and nested_repeat(rule["Regex"]):
            raise UserError(f"{name} splits or replaces with the regex {rule['Regex'][:80]!r}, which repeats a "
                            f"group of repeats or alternatives and can take time without bound: use the model's own "
                            f"tokenizer.json")


def layer_count(names, prefix):
    """How many blocks a set of weight names holds: the distinct N of the names that begin with prefix + 'N.'."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({m.group(1) for m in map(pattern.match, names) if m})


def check_shapes(model, shapes, names, where, fix):
    """UserError in one line at the first of shapes ({name: shape}) that differs from model's parameter names maps
    it to ({theirs: ours}); model is built on the meta device, so that a lie costs no memory."""
    params = dict(model.named_parameters())
    for theirs, ours in names.items():
        if theirs in shapes and ours in params and tuple(shapes[theirs]) != tuple(params[ours].shape):
            raise UserError(f"{theirs} in {where} has shape {tuple(shapes[theirs])}, but the sizes it states "
                             f"imply {tuple(params[ours].shape)}: {fix}")
