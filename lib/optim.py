"""
The optimizers of a run (OPTIMIZERS, the one place their names are known) and its learning rate schedule.

    optimizers = build_optimizers(model, {**settings.defaults(), "optimizer": "muon"}, "cpu")   # [AdamW, Muon]
    factor = lr_factor(500, lr_schedule="wsd", warmup_iters=100, lr_decay_iters=5000)    # 1.0: stable

A new optimizer is a function here taking (named, config, fused): the trainable (name, parameter) pairs, the run's
settings (their defaults in lib/settings.py) and whether torch's fused step may run; it returns a list of optimizers
(groups() splits the decayed matrices from the rest). Its step must make all of its state before any arithmetic, as
torch's do in _init_group: the memory estimate (memory.py's traced_optimizer) steps it on fake tensors, where a step
may stop at an op that asks for a value (a .item()), so state made later would be left out of the estimate.
"""

import inspect
import math

import torch

from lib.files import UserError
from lib.parallel import is_dtensor


def adamw(named, config, fused, kind=torch.optim.AdamW):
    return [kind(groups(named, config), lr=config["learning_rate"], betas=(config["beta1"], config["beta2"]),
                 fused=fused or None)]


def adam(named, config, fused):  # weight decay as torch's Adam does it: an L2 term added to the gradient
    return adamw(named, config, fused, torch.optim.Adam)


def sgd(named, config, fused):  # its fused step has no rule for sharded (DTensor) parameters: foreach under FSDP
    sharded = any(is_dtensor(p) for _, p in named)
    return [torch.optim.SGD(groups(named, config), lr=config["learning_rate"], momentum=config["momentum"],
                            fused=(fused and not sharded) or None)]


def muon(named, config, fused):
    # Muon at muon_lr for the blocks' 2-D matrices (orthogonalized whole), AdamW at learning_rate for the rest
    hidden = [(n, p) for n, p in named if n.startswith("blocks.") and p.dim() == 2]
    rest = [(n, p) for n, p in named if not (n.startswith("blocks.") and p.dim() == 2)]
    optimizers = adamw(rest, config, fused)
    if hidden:
        optimizers.append(torch.optim.Muon([p for _, p in hidden], lr=config["muon_lr"],
                                           weight_decay=config["weight_decay"], momentum=config["muon_momentum"]))
    return optimizers


OPTIMIZERS = {"adamw": adamw, "muon": muon, "adam": adam, "sgd": sgd}  # optimizer=NAME
SCHEDULES = ("cosine", "linear", "polynomial", "constant", "wsd", "cosine_restarts")


def settings_read(name, config):
    """The settings (of config) that optimizer name reads, found by building it over a block's matrix and a vector."""
    read = set()

    class Reads(dict):
        def __getitem__(self, key):
            read.add(key)
            return super().__getitem__(key)
    named = [("blocks.0.w", torch.nn.Parameter(torch.zeros(2, 2))), ("b", torch.nn.Parameter(torch.zeros(2)))]
    try:
        OPTIMIZERS[name](named, Reads(config), False)
    except ValueError:  # a number torch's constructor refuses: said where that optimizer is built (build_optimizers)
        pass
    return read


def groups(named, config):
    # weight decay on matrices only: norms' weights (and any other 1-D parameter) are left alone
    return [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": config["weight_decay"]},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]


def build_optimizers(model, config, device_type):
    """The list of optimizers of config["optimizer"] (OPTIMIZERS) over model's trainable parameters, with the
    run's settings config; the first covers what the others do not, at learning_rate."""
    check_optimizer(config)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = device_type in ("cuda", "cpu")  # one fused kernel for all parameters where there is one
    try:
        return OPTIMIZERS[config["optimizer"]](named, config, fused)
    except ValueError as e:  # torch's constructors check their numbers ("Invalid momentum_decay value: -1.0")
        raise UserError(f"optimizer={config['optimizer']!r} refuses its settings ({e}): set them within their range "
                        f"(lib/settings.py's _IN_RANGE can say it first)") from None


def hyperparameters(optimizers):
    """Each group's hyperparameters but its parameters and learning rate (the schedule's), one list of dicts an
    optimizer: what reapply puts back after a resume."""
    return [[{k: v for k, v in group.items() if k not in ("params", "lr", "initial_lr")}
             for group in opt.param_groups] for opt in optimizers]


def reapply(optimizers, built):
    """After a resume, the groups' hyperparameters as this command built them (built: hyperparameters() before the
    restore), not the checkpoint's -> the names of the numbers that changed, for the run to say so."""
    def number(v):
        return [number(x) for x in v] if isinstance(v, (tuple, list)) else v if isinstance(v, (int, float)) \
            and not isinstance(v, bool) else None
    changed = set()
    for opt, groups in zip(optimizers, built):
        for group, fresh in zip(opt.param_groups, groups):
            changed |= {k for k, v in fresh.items() if number(v) is not None and number(group.get(k)) != number(v)}
            group.update(fresh)
    return sorted(changed)


def check_optimizer(config):
    """UserError, in one line with the fix, for settings config naming an optimizer or schedule no run knows."""
    for key, known in (("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES)):
        if config[key] not in known:
            raise UserError(f"{key}={config[key]!r} is not one of {', '.join(map(repr, known))}")
    if config["decay_lr"] and config["lr_schedule"] != "constant" and config["min_lr"] > config["learning_rate"]:
        raise UserError(f"min_lr={config['min_lr']} is above learning_rate={config['learning_rate']}: the schedule "
                        f"would raise the rate as it decays; set min_lr below it (about learning_rate / 10)")
    if config["lr_cycle_iters"] < 1 or not 0 < config["lr_power"] < math.inf:  # (not NaN either)
        raise UserError(f"lr_cycle_iters={config['lr_cycle_iters']} must be at least 1 and lr_power="
                        f"{config['lr_power']} above 0 and finite")
    if not 0 <= config["lr_decay_fraction"] <= 1:
        raise UserError(f"lr_decay_fraction={config['lr_decay_fraction']} must be between 0 and 1")
    if config["optimizer"] == "muon":  # it orthogonalizes each matrix whole: tensor parallel and FSDP split them
        if config["tp_size"] > 1:
            raise UserError("optimizer='muon' does not run under tensor parallel: use adamw, or tp_size=1")
        if config["fsdp"]:
            raise UserError("optimizer='muon' orthogonalizes whole matrices, and fsdp=True splits them over processes: "
                            "use optimizer='adamw' with fsdp")


def lr_factor(it, decay_lr=True, lr_schedule="cosine", warmup_iters=100, lr_decay_iters=5000, learning_rate=6e-4,
              min_lr=6e-5, lr_decay_fraction=0.2, lr_cycle_iters=1000, lr_power=1.0):
    """The fraction of its peak every learning rate has at step it: a linear warmup, then lr_schedule, each decaying
    one from 1 down to the floor (min_lr / learning_rate) at lr_decay_iters and kept there ('constant' stays at 1)."""
    if not decay_lr:
        return 1.0
    if it < warmup_iters:
        return (it + 1) / (warmup_iters + 1)
    floor = min_lr / learning_rate if learning_rate > 0 else 0.0
    if lr_schedule == "constant":
        return 1.0
    if it >= lr_decay_iters:
        return floor
    if lr_schedule == "wsd":  # stable at the peak, then linear over the last lr_decay_fraction
        decay_start = max(warmup_iters, lr_decay_iters - lr_decay_fraction * lr_decay_iters)
        ratio = max(0.0, it - decay_start) / max(1, lr_decay_iters - decay_start)
        return 1.0 - ratio * (1.0 - floor)
    ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    if lr_schedule in ("linear", "polynomial"):
        return floor + (1.0 - ratio) ** (lr_power if lr_schedule == "polynomial" else 1) * (1.0 - floor)
    if lr_schedule == "cosine_restarts":  # where in its cycle the step is
        ratio = (it - warmup_iters) % lr_cycle_iters / lr_cycle_iters
    return floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - floor)  # cosine


SCHEDULE_SETTINGS = tuple(inspect.signature(lr_factor).parameters)[1:]  # settings of the same names (train.py)


def set_lr(optimizers, peak_lrs, factor):
    for opt, peak_lr in zip(optimizers, peak_lrs):
        for group in opt.param_groups:
            group["lr"] = peak_lr * factor


def run_steps(max_iters, lr_decay_iters, warmup_iters, warmup_ratio=0.0, max_epochs=0, epoch_steps=None,
              decay_lr=True, lr_schedule="cosine", lr_decay_fraction=0.2, step=0):
    """The run's steps as max_epochs (epoch_steps: the steps that make them) and warmup_ratio set them ->
    max_iters, lr_decay_iters, warmup_iters, and what train.py says about them: the epochs' steps (and a resume's,
    from step, inside a warmup that more epochs made longer), and a schedule the run ends before (a stop to resume
    from, or a run shortened with its schedule left as it was)."""
    if max_epochs > 0:  # the run ends after max_epochs epochs, or at max_iters if that comes first
        max_iters, lr_decay_iters = min(max_iters, epoch_steps), min(lr_decay_iters, epoch_steps)
    if warmup_ratio > 0:  # a share of the run's steps: its epochs', whether or not max_iters stops it before them
        warmup_iters = math.ceil(warmup_ratio * (epoch_steps if max_epochs > 0 else max_iters))
    inside = f": from step {step}, where the run goes on, the learning rate is in it" if \
        decay_lr and warmup_ratio > 0 and 0 < step < warmup_iters else ""
    notes = [f"max_epochs={max_epochs}: {max_iters} steps (lr_decay_iters {lr_decay_iters}, warmup {warmup_iters}"
             f"{inside})"] if max_epochs > 0 else []
    if decay_lr and lr_schedule != "constant" and lr_decay_iters > max_iters > 0:  # max_iters ends it first
        before = f" before its {max_epochs} epochs, and" if max_epochs > 0 else ", and"
        notes.append(f"note: max_iters={max_iters} ends the run{before} the learning rate decays over "
                     f"lr_decay_iters={lr_decay_iters} steps: it will not reach min_lr in this run (for a run of "
                     f"{max_iters} steps, set lr_decay_iters={max_iters})")
    # the warmup as the run's settings say it: warmup_ratio's steps where it is set, which warmup_iters then is not
    knob = "warmup_ratio" if warmup_ratio > 0 else "warmup_iters"
    warmup = f"warmup_ratio={warmup_ratio} (a warmup of {warmup_iters})" if warmup_ratio > 0 else \
        f"warmup_iters={warmup_iters}"
    if decay_lr and 0 < max_iters <= warmup_iters:
        notes.append(f"note: {warmup} is not below max_iters={max_iters}: the run ends in its warmup, short of the "
                     f"peak learning rate (lower {knob})")
    elif decay_lr and lr_schedule != "constant" and lr_decay_iters <= warmup_iters and max_iters > 0:
        notes.append(f"note: lr_decay_iters={lr_decay_iters} is not past {warmup}: the learning rate falls from its "
                     f"warmup straight to min_lr, with no decay (raise lr_decay_iters)")
    elif decay_lr and lr_schedule == "wsd" and warmup_iters > lr_decay_iters - lr_decay_fraction * lr_decay_iters \
            and max_iters:  # (lr_factor's own expression: another rounding of it fired at the decay's very start)
        notes.append(f"note: {warmup} reaches into wsd's decay, the last lr_decay_fraction={lr_decay_fraction} of "
                     f"lr_decay_iters={lr_decay_iters} steps: it decays over the {lr_decay_iters - warmup_iters} steps "
                     f"after the warmup (lower {knob} or lr_decay_fraction)")
    return max_iters, lr_decay_iters, warmup_iters, "\n".join(notes)
