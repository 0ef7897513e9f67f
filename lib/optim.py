"""
The optimizers' side of a run: which settings of the learning rate schedule are valid, the fraction of its peak
every learning rate has at a step, and setting it on the optimizers before each update.

    factor = lr_factor(500, lr_schedule="wsd", warmup_iters=100, lr_decay_iters=5000)    # 1.0: stable
"""

import math

from lib.errors import UserError

OPTIMIZERS = ("adamw", "muon", "adam", "sgd")
SCHEDULES = ("cosine", "linear", "polynomial", "constant", "wsd", "cosine_restarts")


def check_optimizer(optimizer, lr_schedule, lr_cycle_iters, lr_power, lr_decay_fraction):
    """UserError, in one line with the fix, for an optimizer or a schedule train.py does not know."""
    if optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer={optimizer!r} is not one of {', '.join(map(repr, OPTIMIZERS))}")
    if lr_schedule not in SCHEDULES:
        raise UserError(f"lr_schedule={lr_schedule!r} is not one of {', '.join(map(repr, SCHEDULES))}")
    if lr_cycle_iters < 1 or lr_power <= 0:
        raise UserError(f"lr_cycle_iters={lr_cycle_iters} must be at least 1 and lr_power={lr_power} above 0")
    if not 0 <= lr_decay_fraction <= 1:
        raise UserError(f"lr_decay_fraction={lr_decay_fraction} must be between 0 and 1")


def lr_factor(it, decay_lr=True, lr_schedule="cosine", warmup_iters=100, lr_decay_iters=5000, learning_rate=6e-4,
              min_lr=6e-5, lr_decay_fraction=0.2, lr_cycle_iters=1000, lr_power=1.0):
    """The fraction of its peak every learning rate has at step it (the settings are train.py's): a linear
    warmup, then lr_schedule from 1 down to the floor (min_lr's fraction of learning_rate) at lr_decay_iters,
    and the floor after it."""
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


def set_lr(optimizers, peak_lrs, factor):
    # every optimizer's groups at factor times that optimizer's own peak (learning_rate, muon_lr)
    for opt, peak_lr in zip(optimizers, peak_lrs):
        for group in opt.param_groups:
            group["lr"] = peak_lr * factor


def run_steps(max_iters, lr_decay_iters, warmup_iters, warmup_ratio=0.0, max_epochs=0, epoch_steps=None):
    """The run's steps as max_epochs (epoch_steps: the steps that make them) and warmup_ratio set them ->
    max_iters, lr_decay_iters, warmup_iters, and what train.py says about them ('' without max_epochs)."""
    if max_epochs > 0:  # the run ends after max_epochs epochs, or at max_iters if that comes first
        max_iters, lr_decay_iters = min(max_iters, epoch_steps), min(lr_decay_iters, epoch_steps)
    if warmup_ratio > 0:
        warmup_iters = math.ceil(warmup_ratio * max_iters)
    if max_epochs <= 0:
        return max_iters, lr_decay_iters, warmup_iters, ""
    note = f"max_epochs={max_epochs}: {max_iters} steps (lr_decay_iters {lr_decay_iters}, warmup {warmup_iters})"
    if lr_decay_iters > max_iters:  # max_iters ends it first: a stop to resume from, or the run's real length
        note += (f"\nnote: max_iters={max_iters} ends the run before its {max_epochs} epochs, and the learning rate "
                 f"decays over lr_decay_iters={lr_decay_iters} steps: it will not reach min_lr in this run (for a run "
                 f"of {max_iters} steps, set lr_decay_iters={max_iters})")
    return max_iters, lr_decay_iters, warmup_iters, note
