"""
A checkpoint read back: a run resumed from it (start.begin's resume: its state checked against this command, with
notes on what the command changes; restore: the optimizers' state, and a sharded checkpoint's weights, into the
model as laid out now), or its model built for use (model_from_checkpoint: trained.py, for sample.py, eval.py and
export.py). A run that begins anew never imports it.

Reading runs no code: only tensors and plain values are unpickled, a folder's .metadata only as DCP's own types
(dcp_metadata.py), and every value is checked before it is used (check_values, meta_model, check_moments).

    checkpoint = load_checked("out/ckpt.pt", {"model", "model_args", "config"})   # or a sharded out/ckpt
    model = model_from_checkpoint(checkpoint)
"""

import math
import os
import pickle
import warnings
import zipfile
import zlib
from dataclasses import asdict, fields
from functools import partial

import torch
import torch.distributed as dist

from lib import checkpoint as ckpt
from lib.bounds import check_shapes, layer_count
from lib.checkpoint import dcp, first_line, parameter_names, sharded_state
from lib.data import SEQUENCES, val_measure
from lib.files import UserError, check_regular, data_fingerprint, tokenizer_fingerprint
from lib.hf import HF_ARCHITECTURES
from lib.optim import SCHEDULE_SETTINGS
from lib.settings import DTYPES, LORA_BASE_DTYPES, check_sizes
from lib.start import LORA_SETTINGS, RUN_SETTINGS, SHAPE, folder_notes
from model import GPT, GPTConfig

# the settings of the run's learning rates and where they end (max_iters: its own note): every one lr_factor takes
# (a new schedule's knob too), and those train.py reads beside it
SCHEDULE = (*SCHEDULE_SETTINGS, "warmup_ratio", "max_epochs", "muon_lr")


def load_checked(path, needed, **load):
    """path's checkpoint (load_checkpoint's, with load's options), checked to be this train.py's and to hold the
    keys needed: a resume's (starting_point), or those sample.py, eval.py and export.py read (trained.load_model)."""
    checkpoint = load_checkpoint(path, **load)
    if isinstance(checkpoint, dict):
        check_not_nanogpts(checkpoint, path)
    missing = needed - checkpoint.keys() if isinstance(checkpoint, dict) else needed
    if missing:
        raise UserError(f"{path} is not a checkpoint of this train.py (it lacks {', '.join(sorted(missing))})")
    check_values(checkpoint, path)
    return checkpoint


def check_resume(checkpoint, config, data_vocab, path):
    """UserError, in one line, where this run's settings (config) cannot continue checkpoint (read from path)."""
    if checkpoint.get("format") != ckpt.FORMAT:
        raise UserError(f"{path} was written by another train.py (checkpoint format {checkpoint.get('format')}, "
                         f"this one resumes {ckpt.FORMAT}): resume it with the train.py that wrote it, or train anew")
    args = checkpoint["model_args"]  # (a dict: check_values)
    check_sizes(args, f"{path}'s model_args", "use another checkpoint")
    # a sharded checkpoint's weights come once the model is built: count its blocks first by the names its
    # param_groups hold (a file checkpoint's hold numbers; model_from_checkpoint counts its weights' names)
    names = [name for group in checkpoint.get("param_groups") or [] for name in group.get("params", [])
             if isinstance(name, str)]
    if names and not args.get("lora_rank") and (blocks := layer_count(names, "blocks.")) != args["n_layer"]:
        raise UserError(f"{path}'s model_args say n_layer={args['n_layer']}, but it holds the weights of "
                         f"{blocks} blocks: use another checkpoint")
    if data_vocab > args["vocab_size"]:
        raise UserError(f"the checkpoint's vocab_size {args['vocab_size']} is smaller than the data's "
                         f"{data_vocab}: resume with the data it was trained on")
    if checkpoint.get("pretrained") and config["block_size"] > args["block_size"]:
        raise UserError(f"block_size={config['block_size']} is past the {args['block_size']} positions of the "
                         f"model {checkpoint['pretrained']}")
    # a pretrained model's shape is its folder's; its adapters are the run's own, and a resume keeps them
    shape = LORA_SETTINGS if checkpoint.get("pretrained") else SHAPE
    # as given and as GPTConfig makes them: mlp_hidden=0 and the width it stands for are one model, and a 0 that
    # stands for another width with n_embd is n_embd's change
    mine, theirs = resolved(config), resolved(args)
    changed = [k for k in shape if k in args and k in config and config[k] != args[k] and mine[k] != theirs[k]]
    if config["vocab_size"] not in (0, args["vocab_size"]) and not checkpoint.get("pretrained"):  # (0: whatever it
        changed.append("vocab_size")  # holds; a folder's model: its own, noted as at the start)
    if changed:
        raise UserError(f"{path} holds a model of {', '.join(f'{k}={args[k]}' for k in changed)}, not "
                         f"{', '.join(f'{k}={config[k]}' for k in changed)}: resume with the checkpoint's shape, "
                         f"or train the new one into another out_dir")
    trained_with = checkpoint["config"].get("optimizer", "adamw")
    if trained_with != config["optimizer"]:
        raise UserError(f"{path} was trained with optimizer={trained_with!r}: resume with --optimizer={trained_with}")


def resume(origin, config, meta, eval_sequences):
    # origin from its checkpoint (a LoRA run's base held as it was: 4 bits stay 4 bits); notes on what changed
    checkpoint, found = origin.checkpoint, origin.found
    check_resume(checkpoint, config, meta["vocab_size"], found)
    trained_on = checkpoint.get("tokenizer_fingerprint")  # (none in a checkpoint from before it was kept)
    if trained_on and trained_on != tokenizer_fingerprint(config["data_dir"], meta):
        raise UserError(f"{config['data_dir']} was prepared with another tokenizer than the one {found} was trained "
                        f"on (its ids would mean other words): resume on the data it was trained on, or train anew "
                        f"into another out_dir")
    origin.pretrained, origin.base_fingerprint = checkpoint.get("pretrained"), checkpoint.get("base_fingerprint")
    origin.model_args = {**checkpoint["model_args"], **{k: config[k] for k in RUN_SETTINGS}}  # (this run's)
    if origin.pretrained:  # its block_size is the model's own limit, not the length trained on
        origin.model_args["block_size"] = checkpoint["model_args"]["block_size"]
    loop = origin.loop = {k: checkpoint[k] for k in ckpt.LOOP}
    origin.lora = origin.model_args.get("lora_rank", 0)
    before = checkpoint["config"]
    if origin.lora:  # the base as it was held: this command may leave the setting out, not change it
        origin.lora_base_dtype = before.get("lora_base_dtype", config["lora_base_dtype"])
        if config["lora_base_dtype"] not in ("auto", origin.lora_base_dtype):
            raise UserError(f"{found} was trained on a base held as lora_base_dtype={origin.lora_base_dtype!r}; "
                            f"resume with that (or leave it out), or train anew into another out_dir")
    origin.notes.append(f"resuming {found} at step {loop['iter_num']}")
    if origin.pretrained:  # the model's settings given here, as at the run's start
        origin.notes += folder_notes(config, origin.pretrained, checkpoint["model_args"], hf=False)
    prepared_again = data_note(origin, checkpoint, config["data_dir"], meta)
    measured = val_measure(config, meta)
    scored_whole = measured[1]  # (val_measure's) else random windows: how many (eval_iters x batch_size x replicas)
    other_windows = not scored_whole and checkpoint.get("eval_sequences", eval_sequences) != eval_sequences
    if (prepared_again or val_measure(before, meta) != measured or other_windows) and loop["best_val_loss"] < math.inf:
        if not config["eval_only"]:  # (which replaces no ckpt_best)
            origin.notes.append(f"note: the val loss is measured otherwise than when {found} was saved (block_size, "
                                f"eval_full, eval_stride, doc_mask, sequences, the val windows read: eval_iters x "
                                f"batch_size x processes, or the data changed): its best val loss "
                                f"{loop['best_val_loss']:.4f} and early stopping's count start anew: the next "
                                f"evaluation replaces ckpt_best (copy it elsewhere to keep the old measure's best)")
        loop["best_val_loss"], loop["evals_without_gain"] = float("inf"), 0
    if 0 < config["early_stop_patience"] <= loop["evals_without_gain"] and not config["eval_only"]:
        origin.stopped = True
        origin.notes.append(f"this run stopped early at step {loop['iter_num']} (no better val loss in "
                            f"{loop['evals_without_gain']} evaluations): nothing to do; raise early_stop_patience "
                            f"to train on")
        return
    # a step's batches depend on these alone, not on how processes and micro-steps share them (batch_size='auto')
    def shaping(c):
        return (c.get("seed"), c.get("sequences"), c.get("block_size"),
                c.get("batch_size", 0) * c.get("gradient_accumulation_steps", 0))
    origin.same_batches = shaping(before) == shaping(config)
    origin.epochs_before = before.get("max_epochs", 0)
    if not origin.same_batches and not config["eval_only"]:  # (which trains on no batches)
        anew = " (and its epochs are counted anew: a ckpt_epoch_N may be written again)" if config["max_epochs"] else ""
        origin.notes.append("warning: seed, sequences, block_size or the sequences of an update (batch_size x "
                            "gradient_accumulation_steps) changed since the checkpoint: training continues, but "
                            f"not on the batches the first run would have seen{anew}")
    elif not config["batch_size_auto"] and not config["eval_only"]:  # (under 'auto' micro_batch.py says it)
        origin.notes += split_note(before, config["batch_size"], config["gradient_accumulation_steps"],
                                   config["dropout"])
    origin.end_notes = partial(schedule_notes, before, config, loop["iter_num"])  # once max_epochs has set the end
    origin.notes += dropout_note(checkpoint, config, origin.model_args)


def data_note(origin, checkpoint, data_dir, meta):
    # a note where the data is another folder than the checkpoint's, or its folder prepared again since (its splits'
    # sizes differ, as returned: the val loss is measured anew); the same tokenizer is checked already
    splits = checkpoint.get("data_fingerprint", {}).get("splits")
    prepared_again = splits not in (None, data_fingerprint(meta)["splits"])
    moved = checkpoint.get("data_dir") is not None and \
        os.path.realpath(checkpoint["data_dir"]) != os.path.realpath(data_dir)  # (a link to it is it)
    if prepared_again or moved:
        said = f"is not the data folder of {origin.found} ({checkpoint['data_dir']})" if moved else \
            f"was prepared again since {origin.found} was saved"
        origin.notes.append(f"note: {data_dir} {said}" + (
            " (its splits' sizes differ): the run goes on through other sequences than it would have seen"
            if prepared_again else ": the run goes on through its sequences (those it would have seen, if a copy)"))
    return prepared_again


def split_note(before, batch_size, accumulation, dropout):
    # [the note] where a resume splits the same updates as batch_size x accumulation, otherwise than its checkpoint
    # (before: its config), under the same dropout (a changed one has its own note): its masks, drawn a micro-step at
    # a time, are not those of the run it continues
    was = (before.get("batch_size", 0), before.get("gradient_accumulation_steps", 0))
    if dropout > 0 and before.get("dropout") == dropout and was != (batch_size, accumulation) and \
            was[0] * was[1] == batch_size * accumulation:
        return [f"note: an update's sequences are split {batch_size} x {accumulation}, not as the checkpoint's: the "
                f"same batches, but dropout draws its masks a micro-step at a time, and they differ from the run it "
                f"continues"]
    return []


def schedule_notes(before, config, step, end):
    # what a resume at step changes of the run's end, its learning rates, dropout, clipping, dtype and step copies
    # (before: the checkpoint's config; end: the run's last step, max_iters or its max_epochs' if sooner)
    if end < step and not config["eval_only"]:  # (the loop ends where it begins)
        knob = "max_iters" if end == config["max_iters"] else "max_epochs"
        return [f"note: {knob}={config[knob]} is behind the checkpoint's step {step}" + (
            "" if knob == "max_iters" else f" (it ends the run at step {end})") +
            f": nothing is trained (raise {knob} to train on)"]
    notes, moved = [], before.get("max_iters") != config["max_iters"] and not config["eval_only"]
    if moved:  # the run's end moves, and with lr_decay_iters its schedule
        was = f" (was {before.get('lr_decay_iters')})" if before.get("lr_decay_iters") != config["lr_decay_iters"] \
            else ""
        cut = f" (or at the {config['max_epochs']} epochs' last, if sooner)" if config["max_epochs"] > 0 else ""
        last = step == before.get("max_iters") and step % before.get("eval_interval", config["eval_interval"])
        ratio, warmup = config["warmup_ratio"], math.ceil(config["warmup_ratio"] * config["max_iters"])
        warmed = math.ceil(before.get("warmup_ratio", 0) * before.get("max_iters", 0)) if before.get(
            "warmup_ratio", 0) > 0 else before.get("warmup_iters", 0)  # the checkpoint's warmup
        if ratio > 0 and not config["max_epochs"]:  # (of the epochs' steps, which max_iters does not move)
            was += f"; warmup_ratio={ratio} makes the warmup {warmup} steps (was {warmed})" + (
                f": from step {step} the learning rate is back in it" if warmed <= step < warmup else "")
        notes.append(f"note: max_iters is {config['max_iters']}, not the checkpoint's {before.get('max_iters')}: "
                     f"the run ends at step {config['max_iters']}{cut}; lr_decay_iters, the schedule's length, is "
                     f"{config['lr_decay_iters']}{cut}{was}" + (
                         f"; step {step}, its last, off eval_interval, was evaluated, and counts for ckpt_best and "
                         f"early stopping as it would in no run that went on past it" if last else ""))
    changed = [k for k in SCHEDULE if before.get(k, config[k]) != config[k] and not (moved and k == "lr_decay_iters")]
    if changed and end > step and not config["eval_only"]:
        notes.append(f"note: the learning rate's schedule is this command's, not the checkpoint's ("
                     f"{'; '.join(f'{k}={config[k]}, was {before[k]}' for k in changed)}): from step {step} on the "
                     f"run differs from the one it continues")
    # more that a resume takes from its command, and that changes the updates (dtype: 'auto' is the machine's)
    taken = [k for k in ("dropout", "grad_clip", "dtype") if config[k] not in ("auto", before.get(k, config[k]))]
    if taken and end > step and not config["eval_only"]:
        notes.append(f"note: {'; '.join(f'{k}={config[k]}, was {before[k]}' for k in taken)}: this command's, not "
                     f"the checkpoint's, from step {step} on")
    if 0 < config["keep_last_n"] < before.get("keep_last_n", 0) and end > step and \
            not config["eval_only"]:  # (a save removes the copies past it)
        notes.append(f"note: keep_last_n={config['keep_last_n']}, was {before['keep_last_n']}: the next save keeps "
                     f"only the last {config['keep_last_n']} step copies (ckpt_NNNNNNN.pt) and removes the older ones")
    return notes


def resolved(settings):
    # GPTConfig's fields of settings, each 0 that stands for a size made the size (n_kv_head, head_size, mlp_hidden),
    # lora_targets the set it names (q,v is v,q)
    try:
        out = asdict(GPTConfig(**{f.name: settings[f.name] for f in fields(GPTConfig) if f.name in settings}))
        return {**out, "lora_targets": set(str(out["lora_targets"]).split(","))}
    except (TypeError, ValueError):  # (sizes GPTConfig refuses: compared as given)
        return settings


def resume_rng(checkpoint, rank, world_size, tp_size, device_type):
    # this process's random state from the checkpoint's (every process's) where as many saved them in replicas of as
    # many processes (a replica's tensor-parallel processes share one dropout stream); else the seed's streams
    rngs = checkpoint["rng"]
    if len(rngs) == world_size and checkpoint["config"].get("tp_size", 1) == tp_size:
        torch.set_rng_state(rngs[rank]["cpu"])
        if device_type == "cuda" and rngs[rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rngs[rank]["cuda"])


def dropout_note(checkpoint, config, model_args):
    # [the note] where dropout (the model's, or its adapters') draws its masks from the seed again (resume_rng): the
    # checkpoint's streams are another number of processes' (eval_only draws none)
    saved = (len(checkpoint["rng"]), checkpoint["config"].get("tp_size", 1))
    now = (dist.get_world_size() if dist.is_initialized() else 1, config["tp_size"])
    if max(config["dropout"], model_args.get("lora_dropout", 0.0)) > 0 and saved != now and not config["eval_only"]:
        return [f"note: dropout's masks are drawn from the seed again: the checkpoint's random streams are those of "
                f"{saved[0]} process(es) (tp_size={saved[1]}), not of these {now[0]} (tp_size={now[1]}), and the "
                f"run goes on otherwise than it would have"]
    return []


# -----------------------------------------------------------------------------
# reading: a file's bytes as checked values


def read_sharded(folder, device="cpu"):
    """A sharded checkpoint's weights, whole, in one process (no group needed), as a file's "model" holds them."""
    try:
        from lib.dcp_metadata import CheckedReader
        reader = CheckedReader(folder)  # UserError for metadata that is not DCP's own, or a shard file missing
        weights = {name.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype, device=device)
                   for name, m in reader.metadata.state_dict_metadata.items() if name.startswith("model.")}
        with warnings.catch_warnings():  # that it reads in one process is what we ask for
            warnings.simplefilter("ignore")
            dcp().load({"model": weights}, storage_reader=reader, no_dist=True)
    except (dcp().api.CheckpointException, RuntimeError, OSError, AttributeError, TypeError) as e:
        raise UserError(f"{folder} is not a readable sharded checkpoint ({first_line(e)}); "
                         f"use another one, e.g. ckpt_best or a ckpt_NNNNNNN") from None
    return weights


def load_checkpoint(path, device="cpu", mmap=False, weights=True, verify=True):
    # weights_only: tensors and plain values alone, and no code in it runs; mmap: tensors are read as they are
    # used (the weights alone never read the optimizer's moments); verify: check_crcs first ("model", mapped: the
    # weights' parts alone, as they are read, never the moments). A damaged or foreign file is a UserError.
    # A sharded folder: its state.pt, and (weights) the weights read whole from its shards.
    if os.path.isdir(path):
        checkpoint = load_checkpoint(os.path.join(path, "state.pt"), device, mmap, verify=bool(verify))
        if weights:
            checkpoint["model"] = read_sharded(path, device)
        return checkpoint
    if verify:
        check_crcs(path, tensors=verify is True or not mmap)
    try:
        with warnings.catch_warnings():  # torch warns about what it refused; our error says it in one line
            warnings.simplefilter("ignore")
            try:
                checkpoint = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
            except RuntimeError:
                if not mmap:
                    raise
                # a file not in torch.save's zip format cannot be mapped: read whole (weights_only refuses it there)
                return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(f"{path} holds objects other than tensors and plain values; refusing to load it "
                         f"(only load checkpoints you trust, with code you have read)") from None
    except Exception as e:  # EOFError, and torch's older reader fails on other bytes in many ways (KeyError, ...)
        raise UserError(f"{path} is not a readable checkpoint ({first_line(e, named=True)}); "
                         f"use another one, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt") from None
    if verify not in (True, False) and mmap and isinstance(checkpoint, dict):
        check_read(path, checkpoint.get(verify))
    return checkpoint


def check_crcs(path, tensors=True):
    """UserError where a byte of the file differs from what was saved: torch.save's zip holds CRC-32s that torch.load
    never checks (about a second a GB from the page cache); a file that is not a zip is left to torch.load to name.
    tensors=False: all parts but the tensors' (check_read checks those read)."""
    check_regular(path, "use another checkpoint, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt")  # a FIFO never ends
    try:
        with zipfile.ZipFile(path) as archive:
            # torch.save stores its parts as they are: a compressed one (a few MB of zeros inflating to GBs) is not its
            packed = next((i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED), None)
            damaged = None if packed else archive.testzip() if tensors else next(
                (i.filename for i in archive.infolist() if "/data/" not in i.filename and not crc_holds(archive, i)),
                None)
    except (zipfile.BadZipFile, OSError, EOFError):
        return
    if packed:
        raise UserError(f"{path} holds a compressed part, {packed}, which torch.save never writes; refusing it (only "
                         f"load checkpoints you trust)")
    if damaged:
        raise UserError(f"{path} is damaged: its part {damaged} is not the bytes that were saved (its checksum "
                         f"differs); use another checkpoint, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt")


def crc_holds(archive, info):
    try:
        archive.read(info)  # (zipfile checks the CRC of what it reads)
        return True
    except zipfile.BadZipFile:
        return False


def check_read(path, tensors):
    """check_crcs' UserError where a storage of tensors (a dict's values, mapped from path by torch.load) is not the
    bytes of its own part. torch maps the file whole, each storage where its part lies: their bytes are the saved
    ones where one base (the mapping's) puts every storage at a part whose size and CRC-32 are its own."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in
                (tensors.values() if isinstance(tensors, dict) else ()) if isinstance(t, torch.Tensor) and t.nbytes}
    if not storages:
        return
    read = {at: (s.nbytes(), zlib.crc32(torch.empty(0, dtype=torch.uint8).set_(s).numpy()))
            for at, s in storages.items()}
    parts = {}  # where each part's bytes begin in the file -> (size, CRC-32)
    with open(path, "rb") as f, zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            f.seek(info.header_offset + 26)  # a local header: 30 bytes, its name's and its extra field's lengths
            name, extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
            parts[info.header_offset + 30 + name + extra] = (info.file_size, info.CRC)
    first = min(read)
    for base in (first - at for at, part in parts.items() if part == read[first]):  # (a base to try: few fit)
        if all(parts.get(at - base) == part for at, part in read.items()):
            return
    check_crcs(path)  # finds the damaged part, and names it; else the file was replaced while it was read
    raise UserError(f"{path} changed while it was read (a run saving over it?): read it again")


def check_not_nanogpts(checkpoint, path):
    """UserError in one line for nanoGPT's own ckpt.pt (model_args name bias; weights transformer.h.N)."""
    args, weights = checkpoint.get("model_args"), checkpoint.get("model")
    names = [str(name).removeprefix("_orig_mod.") for name in weights] if isinstance(weights, dict) else []
    if isinstance(args, dict) and "bias" in args or any(name.startswith("transformer.h.") for name in names):
        raise UserError(f"{path} is nanoGPT's checkpoint (GPT-2 blocks: learned positions, LayerNorm, GELU, "
                         f"biases), which this model cannot load: sample it with nanoGPT's sample.py, or train here "
                         f"anew on the same data folder (nanoGPT's prepared data works as it is)")


def check_values(checkpoint, path):
    """UserError in one line naming a value beside the weights not of the kind train.py saves (a damaged or
    hand-edited file); model_args and moments are checked against the weights later (meta_model, check_moments)."""
    def count(value):
        return type(value) is int and value >= 0

    def rng(value):  # a process's random state, as torch keeps one: tensors of bytes
        return isinstance(value, dict) and all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 or key == "cuda" and t is None
            for key, t in ((k, value.get(k)) for k in ("cpu", "cuda")))

    def optimizer(value):  # a state_dict: moments by parameter index, and the groups' settings
        return isinstance(value, dict) and isinstance(value.get("state"), dict) and groups(value.get("param_groups"))

    def groups(value):
        return isinstance(value, list) and all(isinstance(group, dict) for group in value)

    kinds = {"iter_num": count, "evals_without_gain": count, "skipped_in_a_row": count,
             "world_size": lambda v: count(v) and v > 0, "best_val_loss": lambda v: type(v) is float,
             "evaluated": lambda v: type(v) is bool,
             "config": lambda v: isinstance(v, dict) and isinstance(v.get("data_dir", ""), str),
             "model_args": lambda v: isinstance(v, dict), "scaler": lambda v: isinstance(v, dict),
             "rng": lambda v: isinstance(v, list) and all(map(rng, v)), "optimizer": optimizer,
             "more_optimizers": lambda v: isinstance(v, list) and all(map(optimizer, v)), "param_groups": groups,
             "tokenizer_fingerprint": lambda v: isinstance(v, str), "data_dir": lambda v: isinstance(v, str),
             "data_fingerprint": lambda v: isinstance(v, dict) and all(isinstance(x, (str, type(None)))
                                                                       for x in v.values()),
             **dict.fromkeys(("pretrained", "base_fingerprint"), lambda v: v is None or isinstance(v, str))}
    # and the settings that sample.py, eval.py and export.py read back (config's, model_args'), each of its kind
    def one_of(choices):
        return lambda value: isinstance(value, str) and value in choices

    settings = {"dtype": one_of(DTYPES), "lora_base_dtype": one_of(LORA_BASE_DTYPES),
                "block_size": lambda v: count(v) and v > 0, "eval_stride": lambda v: type(v) is int,
                **dict.fromkeys(("eval_full", "doc_mask"), lambda v: type(v) is bool),
                "sequences": one_of(SEQUENCES), "family": one_of(HF_ARCHITECTURES), "lora_rank": count}
    config, model_args = checkpoint.get("config"), checkpoint.get("model_args")
    parts = [part for part in (config, model_args) if isinstance(part, dict)]
    given = [(name, checkpoint[name], fits) for name, fits in kinds.items() if name in checkpoint] + \
        [(name, part[name], fits) for part in parts for name, fits in settings.items() if name in part]
    for name, value, fits in given:
        if not fits(value):
            raise UserError(f"{path} holds {name}={str(value)[:60]!r}, which train.py never saves: use "
                             f"another checkpoint, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt")
    if isinstance(model_args, dict) and model_args.get("lora_rank") and not isinstance(checkpoint.get("pretrained"),
                                                                                      str):
        raise UserError(f"{path} holds a LoRA run's adapters but not the base folder they go on (pretrained): use "
                         f"another checkpoint, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt")


def check_stored(tensor, what, fix):
    """UserError where a tensor read from a file holds more values than its bytes there (a view with a stride of 0:
    a 5 KB file's weight of 32 GB, made whole by the first op on it)."""
    if isinstance(tensor, torch.Tensor) and tensor.numel() * tensor.element_size() > \
            tensor.untyped_storage().nbytes():
        raise UserError(f"{what} is {tuple(tensor.shape)}, more values than the file stores for it "
                        f"({tensor.untyped_storage().nbytes():,} bytes): {fix}")


def check_moments(state, params, path):
    """UserError in one line where a saved moment has another shape than its parameter (a scalar, as Adam's step,
    belongs to none): loaded, it would fail inside the optimizer's first step, or worse."""
    for index, moments in state["state"].items():
        param = params[index] if type(index) is int and 0 <= index < len(params) else None
        # (an index that names no parameter, or moments that are no dict, are refused as a state that does not fit)
        named = moments.items() if isinstance(moments, dict) and param is not None else [(index, None)]
        for name, value in named:
            check_stored(value, f"{path}'s optimizer state {name!r} for parameter {index}", "use another checkpoint")
            if not isinstance(value, torch.Tensor) or value.dim() and value.shape != param.shape:
                raise UserError(f"{path} holds an optimizer state {name!r} for parameter {index} that does not fit "
                                 f"the model: use another checkpoint, e.g. ckpt_best.pt or a ckpt_NNNNNNN.pt")


def model_from_checkpoint(checkpoint, base_dtype=None, base=True, quantized=None, device=None, **overrides):
    """A train.py checkpoint (load_checkpoint's) -> GPT with its weights. A LoRA run's holds only its adapters: they
    go onto its base folder, read by hf.load_pretrained (base_dtype, quantized, device, overrides; not base: unread)."""
    weights = checkpoint.get("model", {})  # a sharded checkpoint's are read into the model later (restore)
    if not isinstance(checkpoint["model_args"], dict) or not isinstance(weights, dict) \
            or not all(isinstance(name, str) for name in weights):
        raise UserError("the checkpoint's model_args or model is not a dict (of weights by name): use another "
                        "checkpoint")
    args = {**checkpoint["model_args"], **overrides}
    if not args.get("lora_rank"):
        model = meta_model(args, weights)
        try:
            model.load_state_dict(weights, assign=True)
        except RuntimeError as e:  # a tensor missing or left over: load_state_dict lists them all
            why = str(e).splitlines()[-1].strip()[:200]
            raise UserError(f"the checkpoint's weights do not fit its model_args ({why}): use another checkpoint") \
                from None
        return model.materialize()
    from lib.hf import fingerprint, load_pretrained  # a LoRA run's base is a Hugging Face folder
    from lib.lora import add_lora
    folder = checkpoint["pretrained"]
    if not os.path.isdir(folder):
        raise UserError(f"the base model this LoRA run began from is not at {folder}: put it back there")
    if fingerprint(folder) != checkpoint["base_fingerprint"]:
        raise UserError(f"the base model at {folder} is not the one this LoRA run began from (its weights "
                         f"differ): put that model back there")
    model = load_pretrained(folder, base_dtype, None, base, quantized, device, dropout=args["dropout"],
                            use_kernels=args["use_kernels"])
    add_lora(model, args["lora_rank"], args["lora_alpha"], args["lora_dropout"], args["lora_targets"])
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=not base)
    if unexpected or weights and any(p.requires_grad for name, p in model.named_parameters() if name in missing):
        raise UserError("the checkpoint does not hold this model's adapters")
    return model


def meta_model(args, weights):
    # GPT of args on the meta device (the tensors become its weights: no second copy), once its sizes, the
    # tensors' shapes (a sharded checkpoint's come later, in restore) and values check
    fix = "use another checkpoint"
    check_sizes(args, "the checkpoint's model_args", fix)
    if weights and (blocks := layer_count(weights, "blocks.")) != args["n_layer"]:
        raise UserError(f"the checkpoint's model_args say n_layer={args['n_layer']}, but its weights hold "
                         f"{blocks} blocks: {fix}")
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**args))
    except (TypeError, ValueError) as e:  # a name GPTConfig does not know, or a value it cannot use
        raise UserError(f"the checkpoint's model_args do not make a model ({e}): {fix}") from None
    shapes = {name: tensor.shape for name, tensor in weights.items() if isinstance(tensor, torch.Tensor)}
    check_shapes(model, shapes, {name: name for name in shapes}, "the checkpoint", fix)
    for name, tensor in weights.items():
        check_stored(tensor, f"the checkpoint's {name}", fix)
    for name, tensor in weights.items():  # a NaN would only show as a traceback in sampling, or a nan loss
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise UserError(f"the checkpoint's {name} holds a NaN or an infinite value: {fix}")
    return model


# -----------------------------------------------------------------------------
# resuming: the optimizers' state (and a sharded checkpoint's weights) into the model as laid out now


def restore(path, checkpoint, model, optimizers, sharded, lora):
    """Load what the model built from checkpoint still lacks: a sharded checkpoint's weights, resharded to this
    layout, and every optimizer's state, whichever layout saved it. UserError in one line for a damaged one."""
    if os.path.isdir(path) or sharded:  # torch's layouts, imported where shards are (dcp())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    if os.path.isdir(path):  # each process reads what its shards need, resharded from however they were saved
        model_state, optim_state = sharded_state(model, optimizers, lora)
        from lib.dcp_metadata import CheckedReader
        reader = CheckedReader(path)  # UserError for metadata that is not DCP's own, or a shard file missing
        try:
            with warnings.catch_warnings():  # without a process group it warns that it reads in one process
                warnings.simplefilter("ignore")
                dcp().load({"model": model_state, "optimizer": optim_state["state"]}, storage_reader=reader)
        except (dcp().api.CheckpointException, RuntimeError, OSError) as e:
            raise UserError(f"{path} is not a readable sharded checkpoint ({first_line(e)}); resume "
                             f"from another (ckpt_best, ckpt_NNNNNNN)") from None
        optim_state["param_groups"] = checkpoint["param_groups"]
        set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=StateDictOptions(strict=not lora))
    elif sharded:  # a single file into shards: keyed by parameter name, split as the parameters are
        order = parameter_names(model, optimizers[0])
        saved = checkpoint["optimizer"]
        check_moments(saved, [dict(model.named_parameters())[name] for name in order], path)
        groups = [{**group, "params": [order[i] for i in group["params"]]} for group in saved["param_groups"]]
        optim_state = {"state": {order[i]: moments for i, moments in saved["state"].items()}, "param_groups": groups}
        set_state_dict(model, optimizers, model_state_dict={}, optim_state_dict=optim_state,
                       options=StateDictOptions(full_state_dict=True))
    else:
        for opt, state in zip(optimizers, [checkpoint["optimizer"], *checkpoint["more_optimizers"]]):
            check_moments(state, [p for group in opt.param_groups for p in group["params"]], path)
            opt.load_state_dict(state)
