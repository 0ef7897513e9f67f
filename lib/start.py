"""
Where a training run begins: from scratch, a Hugging Face model folder, or its own checkpoint in out_dir (a resume,
or a run that already stopped early), decided once from train.py's settings and what out_dir holds.

    origin = begin(config, vocab_size=128, meta=read_meta("data/stdlib"), fsdp=False, eval_sequences=80)
    model, model_args = first_model(origin, config, "float32")
"""

import atexit
import contextlib
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from lib import checkpoint as ckpt
from lib.files import UserError, lock_folder, read_json, unlock_folder, unwritable
from lib.parallel import stop_together, this_process
from lib.settings import check_sizes, defaults, model_settings
from model import GPT, GPTConfig

# GPTConfig's fields that a resume takes from its command (block_size only from scratch); every other but the
# vocabulary (checked against the data's) is the model's shape, which a resume cannot change
RUN_SETTINGS = ("dropout", "use_kernels", "block_size")
SHAPE = tuple(f.name for f in fields(GPTConfig) if f.name not in (*RUN_SETTINGS, "vocab_size"))
LORA_SETTINGS = tuple(name for name in SHAPE if name.startswith("lora_"))  # the adapters' rank, scale, dropout, targets


@dataclass
class Origin:
    init_from: str  # 'scratch', 'resume' or a Hugging Face folder
    checkpoint: dict | None  # the checkpoint's state on a resume (train.py frees it once restored)
    found: str | None  # the checkpoint's path: ckpt.pt, or a sharded folder
    sharded: bool  # the layout of out_dir's checkpoints: sharded folders (FSDP, tensor parallel) or files
    model_args: dict  # GPTConfig's fields: a new model's, or the checkpoint's with this run's RUN_SETTINGS
    loop: dict  # the training loop's state (checkpoint.LOOP's keys)
    lora_base_dtype: str
    lora: int = 0  # the adapters' rank, 0: off
    pretrained: str | None = None  # the Hugging Face folder the weights began from
    base_fingerprint: str | None = None  # that folder's, to know it again when a LoRA run resumes
    notes: list = field(default_factory=list)  # for the master to print: what this command changes, or why it stops
    stopped: bool = False  # the run stopped early before: there is nothing to do (notes say why)
    same_batches: bool = True  # a resume's steps draw the batches they drew before (seed, sequences, ... unchanged)
    epochs_before: int = 0  # a resume's checkpoint's max_epochs
    end_notes: object = None  # a resume's notes on the run's end and schedule, given the end (resume.schedule_notes)


def claim(out_dir, master):
    """One run writes an out_dir at a time (files.py): the master makes it and holds its lock until it exits; a
    second run stops here in every process with the master's one line, before it reads or writes anything there.
    The master then makes the ckpt a killed first save did not (checkpoint.recover_first_save)."""
    refused = None
    if master:
        try:
            made = not os.path.isdir(out_dir)  # then let go of empty (a refused run leaves no folder)
            os.makedirs(out_dir, exist_ok=True)
            atexit.register(unlock_folder, out_dir, lock_folder(out_dir, "train.py"), made)
            ckpt.recover_first_save(out_dir)
        except OSError as e:  # (a full disk: the lock's line, or the recovered ckpt, could not be written)
            refused = unwritable(out_dir, e)
        except UserError as e:
            refused = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [refused]
        dist.broadcast_object_list(said, src=0)
        refused = said[0]
        if not refused:
            check_shared(out_dir, master)
    if refused:
        raise UserError(refused)


def check_shared(out_dir, master, wait=10.0):
    """Every process sees what the master writes in out_dir, or all stop here in one line before anything trains (on
    each node's own disk a checkpoint would be lost, or never whole): each looks for the master's new probe file for
    up to wait s, as a network file system may show a new file late."""
    token = [secrets.token_hex(8) if master else None]
    dist.broadcast_object_list(token, src=0)
    probe, refused = os.path.join(out_dir, f".shared-{token[0]}"), [None]
    if master:
        try:
            with open(probe, "w") as f:
                f.write(token[0])
        except OSError as e:  # (a full disk: the lock's file had its room already) all stop with the master's line
            with contextlib.suppress(OSError):
                os.remove(probe)
            refused = [unwritable(out_dir, e)]
    dist.broadcast_object_list(refused, src=0)
    if refused[0]:
        raise UserError(refused[0])
    deadline = time.monotonic() + wait
    while not (seen := os.path.isfile(probe)) and time.monotonic() < deadline:
        time.sleep(0.2)
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else this_process())  # (every process has looked once this returns)
    if master:
        os.remove(probe)
    blind = [b for b in blind if b]
    if blind:
        more = f" and {len(blind) - 1} more" if len(blind) > 1 else ""
        raise UserError(f"out_dir={out_dir} is not shared: {blind[0]}{more} cannot see the files rank 0 writes "
                        f"there, and checkpoints would be lost or never whole: put out_dir on storage every node "
                        f"mounts (each may give its own path to it)")


def begin(config, vocab_size, meta, fsdp, eval_sequences, mapped=False):
    """The Origin of the run of config (train.py's settings, as given) on the data of meta, with the model's
    vocab_size and fsdp resolved (tensor parallel brings it), and the val sequences an evaluation reads. Every process
    calls it; UserError if it cannot begin. mapped: a resume maps ckpt.pt (a node's processes share the page cache's
    one copy, where each read its own), for a run whose weights and moments go to a GPU, which leaves no mapping
    (on the CPU they would stay mapped, and a replaced ckpt.pt's disk blocks held)."""
    model_args = {**{k: config[k] for k in model_settings()}, "vocab_size": vocab_size}  # GPTConfig's fields
    check_sizes(model_args, "this run", "set it within its range (model.py's GPTConfig)")
    found = ckpt.find_checkpoint(os.path.join(config["out_dir"], "ckpt.pt"))
    if dist.is_initialized() and dist.get_world_size() > 1:  # or the processes would start from different states
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, found)
        named = [path for path in seen if path]  # the layout that is there: ckpt.pt, or a sharded folder
        if 0 < len(named) < len(seen):
            raise UserError(f"{named[0]} is visible to {len(named)} of {len(seen)} processes: out_dir must be on "
                            f"storage every node shares")
    init_from, checkpoint = starting_point(config["out_dir"], config["init_from"], found, mapped)
    origin = Origin(init_from=init_from, checkpoint=checkpoint, found=found, model_args=model_args,
                    sharded=os.path.isdir(found) if found else fsdp, loop=dict(ckpt.LOOP),
                    lora_base_dtype=config["lora_base_dtype"])
    if checkpoint is not None:
        from lib.resume import resume
        resume(origin, config, meta, eval_sequences)
        if origin.stopped:
            return origin
    elif init_from != "scratch":  # a Hugging Face model folder to fine-tune, with this command's LoRA rank
        origin.pretrained, origin.lora = os.path.abspath(init_from), config["lora_rank"]
    if config["lora_rank"] or origin.lora:  # LoRA's settings, checked where LoRA is taken
        from lib.lora import check_lora
        check_lora(config["lora_rank"], origin.lora, origin.lora_base_dtype, config["tp_size"], fsdp)
    if checkpoint is None and init_from != "scratch":
        from lib.hf import fingerprint  # the folder's, and the tokenizer its data was made with
        from lib.tokenizer import check_tokenizer
        # data for a pretrained model must be made with its own tokenizer, or its ids mean other words
        folder_config = read_json(os.path.join(init_from, "config.json"))
        model_vocab = folder_config.get("vocab_size")
        if type(model_vocab) is not int or model_vocab < 1:
            raise UserError(f"{init_from}/config.json's vocab_size is {model_vocab!r}, not a whole number above 0: "
                            f"use the model's own config.json")
        check_tokenizer(config["data_dir"], meta, init_from, model_vocab)
        try:  # the base is known again by it when a LoRA run resumes
            origin.base_fingerprint = fingerprint(init_from)
        except OSError as e:
            raise UserError(str(e)) from None
        origin.notes += folder_notes(config, init_from, folder_config)
    return origin


def folder_notes(config, folder, own, hf=True):
    # notes for the model's settings given a value of their own (config) that a Hugging Face folder sets otherwise
    # (own: its config.json; hf=False: GPTConfig's fields, as a resume's checkpoint holds them): the model is the
    # folder's (its LoRA adapters are the run's), at its start and at each resume
    from lib.hf import config_from_hf
    try:
        own = asdict(config_from_hf(own)) if hf else own
    except (KeyError, TypeError, ValueError, AttributeError):  # (load_pretrained says in one line what is wrong)
        return []
    default = defaults()
    return [f"note: {k}={config[k]!r} plays no part in this run: the model is {folder}'s, whose {k} is {own[k]!r}"
            for k in (*SHAPE, "vocab_size") if k in default and k in own and k not in LORA_SETTINGS
            and config[k] not in (default[k], own[k])]


def quantized_kind(lora_base_dtype):
    # 'nf4' or 'int8' where lora_base_dtype holds a LoRA run's frozen base quantized (torchao's), else None
    return lora_base_dtype if lora_base_dtype in ("nf4", "int8") else None


def frozen_dtype(lora_base_dtype, dtype):
    # the dtype a LoRA run holds its frozen base in (nf4 and int8 are quantized from it): the run's dtype, or the one
    # lora_base_dtype names. A run's model read back for use (trained.load_model) takes the very same base.
    return getattr(torch, dtype if lora_base_dtype in ("auto", "nf4", "int8") else lora_base_dtype)


def first_model(origin, config, dtype, weights=True, device="cpu"):
    """The model the run begins with, on the CPU, and its model_args: the checkpoint's (a sharded one's weights come
    in resume.restore), a Hugging Face folder's with this run's LoRA adapters, or a new one. Full fine-tuning keeps fp32
    weights (autocast computes in dtype); a frozen LoRA base is held in dtype, or nf4 or int8 quantized from it on
    device, a weight at a time as the folder is read (QLoRA's base is never whole in dtype).
    Not weights: a folder's model with memory for its weights, not yet written (nor resident), that the master's
    fill (parallel.parallelize): its weights are read once, not in every process of a node."""
    checkpoint, model_args, lora = origin.checkpoint, origin.model_args, origin.lora
    check_fused_ops(config["use_kernels"], device)  # where the run will fuse, the fused ops compute model.py's
    base_dtype = frozen_dtype(origin.lora_base_dtype, dtype) if lora else torch.float32
    quantized = quantized_kind(origin.lora_base_dtype) if lora else None
    held = checkpoint["config"].get("dtype", dtype) if checkpoint is not None else dtype  # (saved resolved)
    if lora and base_dtype != frozen_dtype(origin.lora_base_dtype, held):  # a resume's base, else rounded otherwise
        raise UserError(f"{origin.found} holds its frozen base in dtype={held!r} (lora_base_dtype="
                        f"{origin.lora_base_dtype!r}): resume with --dtype={held}, or train anew into another out_dir")
    torch.manual_seed(config["seed"])  # the same initial weights in every process
    if checkpoint is not None and (lora or not os.path.isdir(origin.found)):
        from lib.resume import model_from_checkpoint
        run_settings = {k: model_args[k] for k in RUN_SETTINGS}
        return model_from_checkpoint(checkpoint, base_dtype, True, quantized, device, **run_settings), model_args
    if checkpoint is None and origin.pretrained:
        from lib.hf import load_pretrained
        try:  # (the master may be alone to read the weights, and to meet a NaN in them: all stop with it)
            model, error = load_pretrained(origin.init_from, base_dtype, config["block_size"], weights, quantized,
                                           device, dropout=config["dropout"], use_kernels=config["use_kernels"]), None
        except UserError as e:
            error = str(e)
        stop_together(error)
        if lora:
            from lib.lora import add_lora
            add_lora(model, lora, config["lora_alpha"], config["lora_dropout"], config["lora_targets"])
        return model if weights else model.to_empty(device="cpu").materialize(), asdict(model.config)
    try:  # GPTConfig refuses sizes no model can have (n_embd not a multiple of n_head, ...) with a ValueError
        return GPT(GPTConfig(**model_args)), model_args
    except ValueError as e:
        raise UserError(str(e)) from None


def check_fused_ops(use_kernels, device):
    """Where a model of use_kernels will fuse on device (model.fused): UserError where one of model.py's plain ops
    computes otherwise than the reference kernels.py's fused op is tested against. An edit of model.py's alone (a
    z-loss, GELU for SiLU) would train on a CPU, and not where the fused op runs in its place (train.py's model,
    and sample.py's, eval.py's and export.py's). On small fp32 CPU tensors, in a millisecond."""
    import model
    kernels = model.fused(use_kernels, torch.empty(0, device=device), compiled_too=True)
    if kernels is None:
        return
    g = torch.Generator().manual_seed(0)
    x, w, head = torch.randn(2, 3, 4, 16, generator=g), torch.randn(16, generator=g), torch.randn(8, 16, generator=g)
    angles, targets = torch.rand(3, 8, generator=g), torch.randint(-1, 8, (24,), generator=g)
    pairs = {"rms_norm": (kernels.rms_norm_ref(x, w, 1e-5), model.rms_norm(x, w, 1e-5)),
             "swiglu": (kernels.swiglu_ref(x, x.flip(0)), model.swiglu(x, x.flip(0))),
             "apply_rotary": (kernels.apply_rotary_ref(x, angles.cos(), angles.sin()),
                              model.apply_rotary(x, angles.cos(), angles.sin())),
             "linear_cross_entropy": (kernels.linear_cross_entropy_ref(x.view(24, 16), head, targets),
                                      model.linear_cross_entropy(x.view(24, 16), head, targets))}
    for name, (fused_ref, plain) in pairs.items():
        if fused_ref.shape != plain.shape or not torch.allclose(fused_ref, plain, rtol=1e-5, atol=1e-7):
            raise UserError(f"model.py's {name} computes otherwise than kernels.py's fused {name}, which runs in its "
                            f"place on CUDA (use_kernels): make the two the same ({name}_ref is what the fused op is "
                            f"tested against), or set use_kernels=False")


def described(model, model_args, block_size):
    """The model in one line for the log: its parameters, those trained, and its shape (sizes, settings off
    GPTConfig's default, the block_size trained at, and a pretrained model's own limit where that is longer)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    default = GPTConfig()
    shown = {k: v for k, v in {**model_args, "block_size": block_size}.items()
             if type(v) is int or not hasattr(default, k) or v != getattr(default, k)}
    limit = f" (the model's limit: {model_args['block_size']})" if model_args["block_size"] != block_size else ""
    return f"model: {model.num_params() / 1e6:.2f}M parameters, {trained / 1e6:.2f}M of them trained, {shown}{limit}"


def rng_state(device_type):
    # this process's random state, as a checkpoint keeps it for each process (dropout's stream)
    return {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device_type == "cuda" else None}


def starting_point(out_dir, init_from, found, mapped=False):
    """init_from resolved to 'scratch', 'resume' or a Hugging Face folder by what out_dir holds (found), and a
    resume's checkpoint: 'auto' resumes any, a folder the run that began from it (the same command after a
    preemption). UserError for a run that would overwrite another, or resume nothing."""
    if init_from == "auto":
        init_from = "resume" if found else "scratch"
    if init_from not in ("scratch", "resume"):  # a Hugging Face model folder to fine-tune
        if not os.path.isfile(os.path.join(init_from, "config.json")):
            gpt2 = ("; nanoGPT's 'gpt2' names OpenAI's GPT-2, whose blocks this model.py does not have: start from a "
                    "Llama, Mistral, Qwen2 or Qwen3 folder" if init_from.startswith("gpt2") else "")
            raise UserError(f"init_from={init_from!r} is not 'scratch', 'resume', 'auto' or a Hugging Face model "
                             f"folder (it has no config.json){gpt2}")
        if found:
            from lib.resume import load_checkpoint
            began_from = load_checkpoint(found, mmap=True, weights=False, verify=False).get("pretrained")
            if began_from != os.path.abspath(init_from):
                raise UserError(f"{out_dir} holds a run that began from {began_from or 'scratch'}, not "
                                 f"{os.path.abspath(init_from)}: train into another out_dir")
            init_from = "resume"
    held = sorted(f for f in os.listdir(out_dir) if re.fullmatch(ckpt.NAMES, f)) if os.path.isdir(out_dir) else []
    if held and (init_from != "resume" or not found):  # (a resume that finds copies alone: which to copy)
        folder = " (a sharded folder: to ckpt/)" if any(os.path.isdir(os.path.join(out_dir, f)) for f in held) else ""
        how = "--init_from=resume" if found else f"--init_from=resume once one of them is copied to ckpt.pt{folder}"
        raise UserError(f"{out_dir} holds a run already ({', '.join(held)}): continue it with {how}, or train into "
                        f"another out_dir")
    if init_from != "resume":
        return init_from, None
    if not found:
        raise UserError(f"no checkpoint at {os.path.join(out_dir, 'ckpt.pt')} to resume from (train first, or "
                         f"set init_from='scratch')")
    from lib.resume import load_checked
    # all but a sharded checkpoint's weights and moments, which restore reads
    needed = ckpt.NEEDED - {"model", "optimizer"} | {"param_groups"} if os.path.isdir(found) else ckpt.NEEDED
    checkpoint = load_checked(found, needed, weights=False, mmap=mapped)
    # mapped: scalars (Adam's step) copied, for an optimizer keeps them as they are (on the CPU, or unfused), and one
    # tensor of the file held keeps all of it mapped
    return init_from, tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.dim() == 0 else t,
                               checkpoint) if mapped else checkpoint


