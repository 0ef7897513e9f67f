"""
Train a GPT on token files made by prepare.py. One process on a CPU, a GPU or an Apple chip:

    python train.py config/train_small.py
    python train.py config/train_small.py --batch_size=32 --compile=False

DDP over 8 GPUs on one node, or over several nodes (run the same line on each, with its rank):

    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py
    torchrun --nnodes=4 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 train.py config/train_gpt2.py

Past one device's memory add --fsdp=True, --tp_size=N, --gradient_checkpointing=True (docs/scaling.md).

Continue a run from out_dir/ckpt.pt (or an FSDP run's sharded out_dir/ckpt/) exactly where it stopped: add
--init_from=resume (or use --init_from=auto, which resumes when there is a checkpoint: the same command after
every preemption).
"""

import math
import os
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import configure
from lib import checkpoint as ckpt
from lib import settings
from lib.data import Batches
from lib.files import (UserError, check_data_for_run, check_meta_unchanged, data_fingerprint, one_line_errors,
                      read_meta, tokenizer_fingerprint)
from lib.memory import device_name, measured_mb, memory_estimate, memory_layout, memory_table
from lib.metrics import (Speedometer, attended_keys, open_log, report_evaluation, set_aside, start_clock,
                         time_left, utilization, wall_time)
from lib.optim import SCHEDULE_SETTINGS, build_optimizers, hyperparameters, lr_factor, reapply, run_steps, set_lr
from lib.parallel import (StopRequest, check_replicas, check_same_settings, clip_gradients, end_processes,
                          init_distributed, parallelize, peak_flops, sum_head_gradients, target_shares)
from lib.start import begin, claim, described, first_model, quantized_kind, rng_state

# -----------------------------------------------------------------------------
# 1. settings: every one, with its default and what it does, is in lib/settings.py (the model's are GPTConfig's
# fields); config files and --key=value override them (configurator.py), and each becomes a global here

config = settings.defaults()
one_line_errors("train.py")  # a UserError, ours or a library's, stops the run with its one line (files.py)
configure(config, sys.argv[1:])
settings.check(config)
globals().update(config)  # every setting a global of its own name from here on, as at nanoGPT's top

# -----------------------------------------------------------------------------
# 2. devices and processes: torchrun's (or this one alone) in a (data parallel, tensor parallel) mesh

procs = init_distributed(device, dtype, backend, tp_size, fsdp, fsdp_cpu_offload, dist_timeout)  # parallel.Processes
# the settings that were 'auto' as resolved for this machine (and tensor parallel brings FSDP), then this process's
# place in the run: the master (rank 0) alone prints and writes; dp_rank is its data-parallel replica
device, dtype, backend, fsdp = procs.device, procs.dtype, procs.backend, procs.fsdp
ddp, master, rank, world_size = procs.ddp, procs.master, procs.rank, procs.world_size
device_type, dp_size, dp_rank = procs.device_type, procs.dp_size, procs.dp_rank
check_same_settings(config, data_dir)  # every node started with rank 0's settings and data, or all stop here
if gradient_accumulation_steps % dp_size and not batch_size_auto:  # (under 'auto': micro_batch.py's)
    raise UserError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
                    f"{dp_size} data-parallel replicas (it counts micro-steps over all of them)")
micro_steps = gradient_accumulation_steps // dp_size  # this replica's share
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
# an evaluation reads eval_iters batches of batch_size a process, as given: under 'auto' too, whatever micro-batch
eval_sequences = eval_iters * batch_size * dp_size
ptdtype = getattr(torch, dtype)
autocast = nullcontext() if dtype == "float32" else torch.autocast(device_type, dtype=ptdtype)
claim(out_dir, master)  # one run at a time writes an out_dir (files.py); a second one stops here
preemption = StopRequest()  # SIGTERM or SIGINT from here on: the current step finishes, saves, and the run exits 0

# -----------------------------------------------------------------------------
# 3. data: token files are memory-mapped, never read whole. The sequences of a step are a pure function
# of (seed, step): a resumed run sees exactly the batches it would have seen, and the same tokens
# per update give the same sequences however they are split into processes and micro-steps

meta = read_meta(data_dir)  # meta.json, or nanoGPT's meta.pkl, or GPT-2 tokens with neither
# the model's vocabulary (0: the data's, padded to a multiple of 64; a folder's model: its own, a vocab_size given
# beside it noted), and the token files checked for this run
vocab_size, train_tokens = check_data_for_run(data_dir, meta, vocab_size if init_from in ("scratch", "resume", "auto")
                                              else 0, doc_mask, sequences, block_size)

# -----------------------------------------------------------------------------
# 4. where the run begins: from scratch, from a Hugging Face folder, or from its own checkpoint (start.py)

# (on GPUs a resume maps ckpt.pt: a node's processes share one copy of it in memory, where each held its own)
origin = begin({**config, "dtype": dtype}, vocab_size, meta, fsdp, eval_sequences, mapped=device_type != "cpu")
# settings out of play, then what this command changes of a resumed run, or why it stops
for note in [*settings.unused(config), *origin.notes] if master else ():
    print(note)
if origin.stopped:  # the run stopped early before: the same command again has nothing to do
    sys.exit(0)
# records of an earlier run that left no checkpoint here (it died before its first): kept aside, not appended to
if origin.init_from != "resume" and master and not eval_only and (set_aside_note := set_aside(out_dir)):
    print(set_aside_note)
checkpoint, loop, lora = origin.checkpoint, origin.loop, origin.lora
first_step = loop["iter_num"]  # where this run begins: a signal before it trains a step has nothing to save

# -----------------------------------------------------------------------------
# 5. the model, laid out over the processes, and its optimizers

quantized = quantized_kind(origin.lora_base_dtype)
# a Hugging Face folder's weights (unquantized) are read by the master alone, and sent to the others (parallelize)
sending = origin.checkpoint is None and bool(origin.pretrained) and world_size > 1 and not quantized
# from the checkpoint, the folder, or new (QLoRA: the frozen base in 4 or 8 bits, quantized on the device as it is read)
model, model_args = first_model(origin, config, dtype, master or not sending, device)
if not fsdp:  # (under FSDP it goes to the device one unit at a time, as each is sharded)
    model.to(device)
# Past one device (docs/scaling.md): tensor parallel, checkpointing, compile, then FSDP or DDP
raw_model = model
device_ids = [procs.local_rank] if device_type == "cuda" else None  # DDP's, one GPU a process
model = parallelize(model, procs.mesh, tp_size, fsdp, gradient_checkpointing, compile, ptdtype, fsdp_cpu_offload,
                    ddp=ddp and dp_size > 1, device_ids=device_ids, from_master=sending)
optimizers = build_optimizers(raw_model, config, device_type)  # optim.OPTIMIZERS[optimizer]
peak_lrs = [opt.param_groups[0]["lr"] for opt in optimizers]  # the schedule scales each optimizer's own peak
scaler = torch.amp.GradScaler(device_type, enabled=dtype == "float16")
torch.manual_seed(seed + dp_rank)  # dropout differs between replicas (a replica's tp processes agree)
if checkpoint is not None:
    from lib.resume import restore, resume_rng
    built = hyperparameters(optimizers)  # this command's weight_decay, betas, ...: they stay after the restore
    restore(origin.found, checkpoint, raw_model, optimizers, fsdp, lora)
    if checkpoint["scaler"]:  # (empty from a run not in float16: a float16 resume's scaler begins anew)
        scaler.load_state_dict(checkpoint["scaler"])
    changed = reapply(optimizers, built)
    if changed and master:
        print(f"note: the optimizer's {', '.join(changed)} are this command's, not the checkpoint's")
    resume_rng(checkpoint, rank, world_size, tp_size, device_type)  # its saved dropout stream, if as many processes
layout = dict(dp=dp_size, tp=tp_size, fsdp=fsdp, checkpointing=gradient_checkpointing, offload=fsdp_cpu_offload)
if batch_size_auto:  # the largest micro-batch that fits, for the same updates (docs/scaling.md)
    from lib.micro_batch import auto_micro_batch
    sequences_per_step = gradient_accumulation_steps * batch_size
    batch_size, note = auto_micro_batch(raw_model, sequences_per_step, block_size, memory_budget, layout, checkpoint,
                                        autocast, origin.same_batches, dtype=dtype, optimizer=optimizer,
                                        quantized=quantized, device=device)
    gradient_accumulation_steps = sequences_per_step // batch_size
    micro_steps = gradient_accumulation_steps // dp_size
    config.update(batch_size=batch_size, gradient_accumulation_steps=gradient_accumulation_steps)  # for a resume
    if master:
        print(note)
checkpoint = origin.checkpoint = None  # free it
peak = peak_flops(device, ptdtype)
if master:  # the sizes as they are now (batch_size='auto' has shared out the sequences of an update), and the model
    print(f"{world_size} process(es) on {device_type}, {dtype}; tokens per update: {tokens_per_iter:,} "
          f"({gradient_accumulation_steps} micro-steps x {batch_size} sequences x {block_size} tokens)")
    print(described(raw_model, model_args, block_size))
# what each process should hold, by kind, before the first step (on CUDA the first log line adds the measured)
memory = memory_estimate(raw_model, batch_size, block_size, dtype, optimizer, quantized=quantized,
                         micro_steps=micro_steps, device=device_type, **layout)
if master:
    print(memory_table([(memory_layout(**layout), memory)]))

# -----------------------------------------------------------------------------
# 6. the sequences (data.py): shuffled windows, or whole examples packed best-fit attending only within themselves,
# every one once per epoch (or random windows). Sequence n of the run is the same however processes share steps

batches = Batches(data_dir, meta, block_size, seed, model_args["vocab_size"], sequences, batch_size,
                  gradient_accumulation_steps * batch_size, train_tokens, eval_sequences, doc_mask, eval_full,
                  eval_stride, device)
epoch_steps = batches.steps_for(max_epochs) if max_epochs > 0 else None  # (and where the epochs end)
if master and origin.epochs_before and origin.same_batches and loop["iter_num"] < max_iters and \
        (lost := batches.padded_before(origin.epochs_before, loop["iter_num"])):
    print(f"warning: {lost} sequences of the next epoch were padding in the checkpoint's last step (its max_epochs="
          f"{origin.epochs_before}): they are not trained")
max_iters, lr_decay_iters, warmup_iters, steps_note = run_steps(max_iters, lr_decay_iters, warmup_iters, warmup_ratio,
                                                                max_epochs, epoch_steps, decay_lr, lr_schedule,
                                                                lr_decay_fraction, loop["iter_num"])
eval_batches = batches.evaluation_batches(dp_size)  # as many in every process
if master:
    print(batches.describe(eval_iters) + (f"\n{steps_note}" if steps_note and not eval_only else ""))
for note in origin.end_notes(max_iters) if master and origin.end_notes else ():  # what a resume changes of them
    print(note)
epoch_copies = int(batches.epoch(max_iters)) - int(batches.epoch(loop["iter_num"])) if save_every_epoch else 0
# out_dir's room for the run's saves, now, not hours in (eval_only writes none)
room_warning = None if eval_only else ckpt.check_room(out_dir, memory["checkpoint"], keep_last_n, epoch_copies)
if room_warning and master:
    print(room_warning)
# the learning rate's schedule: every setting optim.lr_factor takes (a new schedule's knob too), with the steps as
# max_epochs and warmup_ratio made them
schedule = {name: globals()[name] for name in SCHEDULE_SETTINGS}

# -----------------------------------------------------------------------------
# 7. what the loop calls: evaluation, checkpoints, logging

config.update(device=device, dtype=dtype, backend=backend, vocab_size=model_args["vocab_size"],
              init_from=origin.init_from, lora_base_dtype=origin.lora_base_dtype)  # as resolved
# what every checkpoint holds beside the tensors, the loop's state and the random states
about_run = {"model_args": model_args, "config": config, "world_size": world_size,
             "data_dir": os.path.abspath(data_dir),  # for sample.py, from wherever it runs
             "pretrained": origin.pretrained,  # the Hugging Face folder the run began from, if any
             "base_fingerprint": origin.base_fingerprint, "memory_device": device_name(device),
             "tokenizer_fingerprint": tokenizer_fingerprint(data_dir, meta),  # (resume.resume, trained.load_model)
             "data_fingerprint": data_fingerprint(meta),  # its splits, chat template (resume.resume, trained.run_chat)
             "eval_sequences": eval_sequences}  # the val windows an evaluation reads (resume.resume)
check_meta_unchanged(data_dir, meta)  # not prepared again since read: the files opened, the tokenizer fingerprinted
saving = dict(sharded=origin.sharded, lora=lora, keep_last_n=keep_last_n)
log, close_log = open_log(out_dir, config, master and not eval_only, wandb_log, wandb_project, wandb_run_name,
                          tensorboard_log, loop["iter_num"])  # (eval_only writes nothing)
if eval_tasks and master:  # the tasks are checked, and their data loaded, before the first step (docs/evaluation.md)
    from lib import harness  # here, not on top: lm-evaluation-harness adds half a second to every run's start
    task_model = harness.for_training(raw_model, about_run, device, autocast, batch_size, eval_tasks, eval_tasks_path,
                                      eval_tasks_limit)
speed, logged = Speedometer(), False  # the steps since the last log line: their time and attention keys
clock = start_clock()  # the time left (metrics.py), from the step and evaluation times of this process
# A checkpoint of an evaluated step (or of one that ends an epoch) is held back until the next update has computed
# its gradient at those weights: written then if the gradient is finite, dropped if not (settle_held_back). So every
# checkpoint written along the way is of weights that still gave a finite gradient, and a run that diverges
# (learning_rate=1e9: one finite update, then nothing but NaN) stops with ckpt.pt from before the update that broke it.
held_back = None  # the checkpoint held back (hold_back): why it is saved, and the random state at that step


def stop_requested():
    # whether a signal asked the run to stop, as every process agrees (each got it, or one of them did)
    if not ddp:
        return preemption.requested
    stop = torch.full((1,), float(preemption.requested), device=device)
    dist.all_reduce(stop)
    return stop.item() > 0


@torch.no_grad()
def estimate_loss(model, raw_model):
    # mean loss and next-token accuracy over every trained target of the same batches every time (eval_batches of
    # each split), over all processes. The raw model computes them a chunk of logits at a time.
    model.eval()
    out = {}
    for split in ("train", "val"):
        sums = torch.zeros(3, device=device)  # loss and accuracy, each times its targets; the targets
        for k in range(eval_batches[split]):
            if stop_requested():  # a signal: this evaluation is dropped (the resume makes it), and None says so
                model.train()
                return None
            batch = batches.evaluation(split, k * dp_size + dp_rank)
            if batch is None and not fsdp:  # past the sequences an evaluation reads: this process's share was short
                continue
            if batch is None:  # under FSDP each forward gathers every process's shards: one with no targets
                x, y, doc_ids = batches.evaluation(split, 0)
                batch = x, torch.full_like(y, -1), doc_ids
            x, y, doc_ids = batch
            with autocast:
                loss, accuracy = raw_model.loss_and_accuracy(x, y, doc_ids)
            targets = (y != -1).sum().float()
            sums += torch.stack([loss.float() * targets, accuracy.float() * targets, targets])
        if ddp:
            dist.all_reduce(sums)
        out[split], out[f"{split}_accuracy"] = (sums[:2] / sums[2].clamp(min=1)).tolist()
    model.train()
    return out


def stop_run():
    # A signal stops the run (every process calls it, agreed): this step saved, and one line for the run (a process
    # that got no signal itself: one of another's). The same command with --init_from=auto goes on from here. Where
    # no step was trained yet (a Ctrl-C while the run starts), nothing is saved: out_dir stays as it was.
    if loop["iter_num"] == first_step:
        if master:
            print(f"{preemption.by}: stopped before the run's first step; nothing saved, {out_dir} is as it was",
                  flush=True)
        return
    save_last(False)
    if master:
        print(f"{preemption.by}: saved step {loop['iter_num']} in {out_dir} and stopped; the same command with "
              f"--init_from=auto continues from it", flush=True)


def save_checkpoint(loop, improved, finished_epoch=None, rng=None):
    # Every process calls it. rng: this process's random state at the step saved (a save held back to the next
    # step passes its own); every process's dropout stream is kept, for an exact resume.
    rng = rng or rng_state(device_type)
    rngs = [None] * world_size if ddp else [rng]
    if ddp:  # to the master, which alone writes them (an all-gather sent each process all of them)
        dist.gather_object(rng, rngs if master else None, dst=0)
    if ddp and not fsdp:  # the master's weights are saved: every replica's must be the same
        check_replicas(raw_model, loop["iter_num"])
    state = {"format": ckpt.FORMAT, "scaler": scaler.state_dict(), **loop, **about_run, "rng": rngs}
    ckpt.save(out_dir, state, raw_model, optimizers, improved=improved, finished_epoch=finished_epoch, **saving)


def save_last(improved):
    # The run ends here (its last step, an early stop, a signal): nothing comes after to vouch for this state. Where
    # the last update was skipped, these very weights gave its non-finite gradient: nothing is saved, the run stops.
    if loop["skipped_in_a_row"]:
        raise ckpt.diverged(out_dir, loop["skipped_in_a_row"])
    save_checkpoint(loop, improved, held_back and held_back["epoch"])  # (the epoch this step ended, if it did)


def hold_back(**why):
    # This step's checkpoint, for its evaluation (improved, evaluated) or for the epoch it ended (epoch), or both in
    # one save, waits for the next update's gradient (settle_held_back)
    global held_back
    held_back = held_back or {"improved": False, "epoch": None, "evaluated": False, "rng": rng_state(device_type)}
    held_back.update(why)


def evaluate(step):
    # The losses at this step, logged; its checkpoint saved (at the end) or held back (see held_back). Returns
    # True where the run ends here: eval_only, a signal, or no better val loss in early_stop_patience evaluations.
    eval_began = time.time()
    losses = estimate_loss(model, raw_model)
    if fsdp:  # a forward with no backward leaves the root unit's weights gathered: back to shards before a save
        model.reshard()
    if losses is None:  # stopped by a signal: the step is saved unevaluated; eval_only has no result (status 1)
        if eval_only:
            raise UserError(f"{preemption.by} stopped the evaluation before its end; eval_only wrote nothing")
        stop_run()
        return True
    loop["evaluated"] = True
    task_scores = harness.task_metrics(*task_model, eval_tasks_limit) if eval_tasks and master else {}
    improved = losses["val"] < loop["best_val_loss"] - early_stop_min_delta
    unimproved = {"best_val_loss": loop["best_val_loss"], "evals_without_gain": loop["evals_without_gain"] + 1}
    loop.update({"best_val_loss": losses["val"], "evals_without_gain": 0} if improved else unimproved)
    report_evaluation(log, master, step, losses, task_scores, batches.epoch(step),
                      learning_rate * lr_factor(step, **schedule))
    if eval_only:  # nanoGPT's: the losses of the model as it is, and nothing trained or saved
        return True
    early_stop = early_stop_patience > 0 and loop["evals_without_gain"] >= early_stop_patience
    if step > 0 and (improved or always_save_checkpoint or early_stop or step == max_iters):
        if step >= max_iters or early_stop:
            save_last(improved)
        else:  # saved in the next update, once its gradient is finite (settle_held_back)
            hold_back(improved=improved, evaluated=True, unimproved=unimproved)
    if early_stop:
        if master:
            print(f"early stop: no better val loss in {early_stop_patience} evaluations")
        return True
    speed.restart()  # evaluation time is not training time
    if master and clock["eval_seconds"] is None:  # the first one: what an evaluation costs the run
        print(f"an evaluation took {time.time() - eval_began:.1f} s ({eval_batches['train']} train and "
              f"{eval_batches['val']} val micro-batches a process: eval_iters "
              f"{'(train; the val split and eval_stride val) ' if eval_full else ''}and eval_interval set its share)")
    clock["eval_seconds"] = time.time() - eval_began
    return False


def settle_held_back(finite):
    # Once per update, when its gradient is known: the checkpoint held back for the weights it was computed at is
    # written if the gradient is finite (a good state), and dropped if not (ckpt.pt stays the last good state). The
    # save's time is taken out of the training time that tokens/s and the time left measure.
    global held_back
    if held_back and finite:
        began = time.time()
        save_checkpoint(loop, held_back["improved"], held_back["epoch"], rng=held_back["rng"])
        seconds = time.time() - began
        speed.pause(seconds)
        if held_back["evaluated"]:  # the evaluation's time (a resumed run may not have evaluated yet)
            clock["eval_seconds"] += seconds
    elif held_back and held_back["improved"]:  # an improvement whose save is dropped counts as none (best, patience)
        loop.update(held_back["unimproved"])
    held_back = None


def log_progress(step, loss, lr, grad_norm):
    # the master's line and record for the steps since the last one: time, tokens/s, MFU, memory, time left
    global logged
    dt = speed.seconds_per_step()
    tokens_per_s = tokens_per_iter / dt
    # the first line on CUDA puts the measured peak beside the estimate printed at the start
    memory_note = f" (estimate {memory['device'] / 2**20:,.0f} MB)" if device_type == "cuda" and not logged else ""
    logged = True
    keys = speed.keys / (speed.steps * micro_steps * batch_size * block_size)  # this process's, per query
    mfu, mfu_run, mfu_note = utilization(raw_model, block_size, keys, tokens_per_s / world_size, peak)
    left, left_note = time_left(clock, step, max_iters, eval_interval, dt, speed.steps)
    epoch, mem_mb = batches.epoch(step), measured_mb(device)
    print(f"iter {step}: loss {loss:.4f}, lr {lr:.2e}, grad norm {grad_norm:.3f}, epoch {epoch:.2f}, "
          f"{dt * 1000:.0f} ms/iter, {tokens_per_s:,.0f} tok/s, MFU {mfu_note}, mem {mem_mb:,.0f} MB"
          f"{memory_note}{left_note}")
    log({"iter": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, "ms_per_iter": dt * 1000,
         "tokens_per_s": tokens_per_s, "mfu": mfu, "mfu_run": mfu_run, "mem_mb": mem_mb,
         "epoch": epoch, "time_left_s": left})
    speed.restart()


def step_batches(step):  # this process's micro-batches of an update
    return [batches.train(step, dp_rank * micro_steps + micro) for micro in range(micro_steps)]


# -----------------------------------------------------------------------------
# 8. the training loop

upcoming = None  # the next update's micro-batches, once the update before has asked for them
while True:
    step = loop["iter_num"]  # the step this pass evaluates, then updates
    # evaluate (and checkpoint) every eval_interval steps and at the end
    if eval_only or (step % eval_interval == 0 or step == max_iters) and not loop["evaluated"]:
        if evaluate(step):
            break
    if step >= max_iters:
        break

    # one update: micro-steps with gradient sync only on the last, then clip and step
    epoch_before = int(batches.epoch(step)) if save_every_epoch else None
    factor = lr_factor(step, **schedule)
    set_lr(optimizers, peak_lrs, factor)
    lr = learning_rate * factor
    loss_sum = torch.zeros((), device=device)
    keys_run = torch.zeros((), device=device, dtype=torch.long)  # keys the queries attend to: the FLOPs run
    micro_batches = upcoming or step_batches(step)  # fetched while the step before computed
    # micro-batches that hold different numbers of targets (batches.weighted): each one's loss weighed by its share
    shares = target_shares(micro_batches, dp_size, tp_size, ddp) if batches.weighted else None
    for micro, (x, y, doc_ids) in enumerate(micro_batches):
        last = micro == micro_steps - 1
        if fsdp:  # gradients summed unsharded on each process, reduced and split once, after the last
            raw_model.set_requires_gradient_sync(last)
        # the documents' mask made here, outside a compiled model, which a new one each batch would recompile
        mask = None if doc_ids is None else raw_model.attention_mask(doc_ids)
        with (model.no_sync() if isinstance(model, DDP) and not last else nullcontext()), autocast:
            _, loss = model(x, y, mask=mask)
            loss = loss * shares[micro] if shares is not None else loss / micro_steps
        scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
        B, T = x.shape
        keys_run += attended_keys(doc_ids) if doc_ids is not None else B * T * (T + 1) // 2  # causal
    if tp_size > 1:  # weights every head shares (qk_norm's): each process has their gradient over its own heads
        sum_head_gradients(raw_model, procs.mesh)
    # the next step's micro-batches, read and copied to the device while this one computes: not on its way
    upcoming = step_batches(step + 1) if step + 1 < max_iters else None
    stop = torch.full((1,), float(preemption.requested), device=device)  # made there: a copy to it would wait
    if ddp:  # every process agrees on the mean loss and on whether to stop
        both = torch.cat([loss_sum.view(1), stop])
        dist.all_reduce(both)
        loss_sum, stop = both[0] / world_size, both[1:]
    for opt in optimizers:
        scaler.unscale_(opt)
    grad_norm = clip_gradients(raw_model, grad_clip if grad_clip > 0 else float("inf"))
    # one copy to the host per step: on a GPU each .item() waits for all the work queued before it
    # (the norm of gradients offloaded to the CPU is on the CPU)
    step_values = torch.cat([loss_sum.view(1), grad_norm.view(1).float().to(device), stop, keys_run.view(1).float()])
    loss_value, grad_norm_value, stop_value, keys_value = step_values.tolist()
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm_value)
    # float16's gradient scaler overflowing (a finite loss, an infinite gradient at a scale of 1 or more) is no
    # divergence: it skips the update and halves its scale, as it does every so often, and says nothing against
    # the weights a checkpoint held back is of
    overflowed = not finite and math.isfinite(loss_value) and scaler.is_enabled() and scaler.get_scale() >= 1
    settle_held_back(finite or overflowed)
    if finite:
        for opt in optimizers:
            scaler.step(opt)
        loop["skipped_in_a_row"] = 0
    elif not overflowed:  # a non-finite loss or gradient: apply nothing, not even to the optimizer's moments
        loop["skipped_in_a_row"] += 1
        if master:
            print(f"iter {step + 1}: skipped, loss {loss_value}, grad norm {grad_norm_value} "
                  f"({loop['skipped_in_a_row']} in a row)")
        log({"iter": step + 1, "loss": loss_value, "grad_norm": grad_norm_value, "skipped": True})
    scaler.update()
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    if loop["skipped_in_a_row"] >= max_skipped_steps:
        raise ckpt.diverged(out_dir, loop["skipped_in_a_row"])
    loop["iter_num"] += 1
    loop["evaluated"] = False  # the new step's evaluation is still to come
    speed.step(keys_value)

    if loop["iter_num"] % log_interval == 0 and master and finite:
        log_progress(loop["iter_num"], loss_value, lr, grad_norm_value)
    # this step finished an epoch: kept as ckpt_epoch_N (held back as an evaluation's checkpoint is), where its update
    # was applied (a skipped one's weights gave a non-finite gradient)
    if save_every_epoch and int(batches.epoch(loop["iter_num"])) > epoch_before and not loop["skipped_in_a_row"]:
        hold_back(epoch=int(batches.epoch(loop["iter_num"])))
    if stop_value > 0:  # every process sees the same flag, so all stop after the same step
        stop_run()
        break

if master and not eval_only and loop["evaluated"] and loop["iter_num"] > 0 and math.isfinite(loop["best_val_loss"]) \
        and ckpt.find_checkpoint(os.path.join(out_dir, "ckpt_best.pt")) is None:  # (a fine-tune that only got worse)
    came = ("it came before the checkpoint resumed from, whose run's ckpt_best (if any) this out_dir lacks" if
            origin.found else "the model the run began from scored best (lower learning_rate)")
    print(f"note: no evaluation {'of this resume' if origin.found else 'after step 0'} lowered the best val loss "
          f"{loop['best_val_loss']:.4f}, so no ckpt_best was written: {came}")
close_log()  # TensorBoard writes out what it buffers
if master:
    print(wall_time(loop["iter_num"]))
if dist.is_initialized():
    del model  # and DDP's reducer with it, before the group ends (parallel.end_processes)
    end_processes()
