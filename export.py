"""
Export a training run as a Hugging Face folder for transformers, vLLM and llama.cpp's converter: config.json,
model.safetensors (shards past 5 GB) and a tokenizer that encodes exactly as the training data was. A LoRA run
is merged into its base (in fp32, then cast), or written alone as a peft adapter. A --to ending in .gguf writes
one GGUF file for llama.cpp and Ollama instead (pip install gguf).

    python export.py --out_dir=out-finetune --to=models/finetuned
    python export.py --out_dir=out-finetune --ckpt=ckpt_best.pt --to=models/finetuned --dtype=bfloat16
    python export.py --out_dir=out-lora --to=adapters/mine --adapter    # peft: adapter_config.json + weights
    python export.py --out_dir=out --to=model.gguf --dtype=float16      # then: llama-cli -m model.gguf

Then: AutoModelForCausalLM.from_pretrained("models/finetuned") and AutoTokenizer.from_pretrained(...), or
PeftModel.from_pretrained(base_model, "adapters/mine").
"""

import argparse
import json
import os
import re
import shutil
import signal
import tempfile

import torch

from lib.bounds import confined
from lib.files import UserError, durable_replace, one_line_errors, open_own, read_json
from lib.hf import save_pretrained
from lib.lora import merge_lora, write_adapter
from lib.parallel import pick_device
from lib.start import frozen_dtype, quantized_kind
from lib.tokenizer import bases_tokenizer
from lib.tokenizer_json import hf_tokenizer_files
from lib.trained import load_run, run_chat, run_special_ids


def load_exported(args):
    # load_run's (model, tokenizer, checkpoint), with the folder the run began from (if any) still there; an adapter
    # alone needs none of the base's weights (a 70B base: 140 GB read for a few MB; nor torchao for a quantized one)
    device = pick_device(args.device)[0]  # where a QLoRA run's base is quantized again (torchao's nf4 on a CPU: 2.4 h
    # at 70B), and merged a weight at a time into the CPU's copy that is written
    model, tokenizer, checkpoint = load_run(os.path.join(args.out_dir, args.ckpt), args.data_dir, not args.adapter,
                                            device)
    base = checkpoint.get("pretrained")
    if base and not os.path.isdir(base):
        raise UserError(f"the base model this run began from is not at {base}, and its export takes the base's "
                        f"special tokens and tokenizer files from there: put it back there")
    return model, tokenizer, checkpoint


def write_tokenizer(tokenizer, checkpoint, folder, ids):
    """Writes the run's tokenizer (transformers' files, chat template) into folder; ids: run_special_ids' -> a note."""
    base = checkpoint.get("pretrained") or ""
    files, note = hf_tokenizer_files(tokenizer)
    for name, text in files.items():
        with open_own(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    # a base's generation defaults go along, and its tokenizer_config.json where the data was made with its tokenizer
    names, jinja = ["generation_config.json"] if base else [], None
    if bases_tokenizer(tokenizer, base):
        names += ["tokenizer_config.json", "special_tokens_map.json"]
        jinja = base_jinja(base)  # a newer folder's template, beside tokenizer_config.json: into it here
    for name in names:
        if os.path.lexists(os.path.join(base, name)):
            carry(base, name, folder)
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        write_json(os.path.join(folder, "generation_config.json"), ids)
    config_path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_path):
        # a prompt is encoded as prepare.py encoded the data (its BOS, if any, no EOS), whatever the base says
        config = read_json(config_path) | ({"chat_template": jinja} if jinja else {})
        write_json(config_path, {**config, "add_bos_token": tokenizer.bos_id is not None, "add_eos_token": False})
    chat = run_chat(checkpoint)
    if chat and files:
        write_chat(folder, chat, tokenizer.eot_id)
    return note


def base_file(base, name, what, limit=1 << 20):
    # a base folder's file, which an export carries and a user may publish, as bytes: only a regular file inside
    # the base (a link planted there could name a private key), of at most limit bytes
    path = confined(base, name, f"the base model folder {base}")
    if os.path.getsize(path) > limit:
        raise UserError(f"{path} is over {limit:,} bytes, not {what}: replace it with the model's own, or remove it")
    return path, path.read_bytes()


def carry(base, name, folder):
    path, data = base_file(base, name, "the JSON file its name says")
    try:
        if not isinstance(json.loads(data), dict):
            raise ValueError("not an object")
    except ValueError as e:
        raise UserError(f"{path} is not the JSON object its name says ({e}): replace it with the model's own, "
                        f"or remove it") from None
    with open_own(os.path.join(folder, name), "wb") as f:
        f.write(data)


def base_jinja(base):
    # a base's chat_template.jinja (transformers reads it before tokenizer_config.json's) as text, or None
    if not os.path.lexists(os.path.join(base, "chat_template.jinja")):
        return None
    path, data = base_file(base, "chat_template.jinja", "a chat template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text, not a chat template: replace it with the model's own, or "
                        f"remove it") from None


def write_json(path, content):
    with open_own(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, ensure_ascii=False)


def write_chat(folder, chat, eot_id):
    # a chat run: its template (markers are special tokens) in tokenizer_config.json; generation stops at end of turn
    config = read_json(os.path.join(folder, "tokenizer_config.json"))
    config.update(chat_template=chat["template"], split_special_tokens=False)
    for name in ("bos_token", "eos_token"):  # the tokens the data's template was rendered with, which it names
        if chat.get(name):
            config[name] = chat[name]
    generation = read_json(os.path.join(folder, "generation_config.json"))  # the base's, or write_tokenizer's
    eos = generation.get("eos_token_id", [])
    eos = [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    generation["eos_token_id"] = list(dict.fromkeys([chat["end_of_turn_id"], *eos, eot_id]))
    write_json(os.path.join(folder, "tokenizer_config.json"), config)
    write_json(os.path.join(folder, "generation_config.json"), generation)


def held_base(checkpoint, base):
    # how a LoRA run held its base where that is rounder than the folder base's own dtype: in 4 or 8 bits ('nf4',
    # 'int8'), or in a float dtype ('bfloat16' from an fp32 folder); else None
    config = checkpoint["config"]
    if not checkpoint["model_args"].get("lora_rank"):
        return None
    kept = str(frozen_dtype(config.get("lora_base_dtype", "auto"), config["dtype"])).removeprefix("torch.")
    return quantized_kind(config.get("lora_base_dtype")) or (kept if kept not in ("float32", export_dtype("auto", base))
                                                              else None)


def export_dtype(dtype, base):
    # --dtype; auto: the dtype the run began from (its base's config.json's), else (none, or one we do not write:
    # float64, "auto") the checkpoint's, float32
    if dtype != "auto":
        return dtype
    try:
        config = read_json(os.path.join(base, "config.json")) if base else {}
    except ValueError:
        config = {}
    named = config.get("torch_dtype") or config.get("dtype")
    return named if named in ("bfloat16", "float16") else "float32"


# what this script writes in a folder: --overwrite replaces a folder that holds nothing else
EXPORTED = re.compile(r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|adapter_config)"
                      r"\.json|(model|adapter_model)\.safetensors|model-[0-9]+-of-[0-9]+\.safetensors|"
                      r"model\.safetensors\.index\.json")


def make_parent(to):
    """Makes --to's folder where missing -> the first folder made (None: none), which a failed export removes."""
    first, path = None, os.path.dirname(os.path.abspath(to))
    while not os.path.lexists(path):
        first, path = path, os.path.dirname(path)
    if not os.path.isdir(path):
        raise UserError(f"--to={to}: {path} is not a folder; choose another --to")
    try:
        os.makedirs(os.path.dirname(os.path.abspath(to)), exist_ok=True)
    except OSError as e:
        raise UserError(f"--to={to}: cannot make its folder ({e.strerror}); choose another --to") from None
    return first


def check_destination(args):
    # --to: an empty or new folder, or (--overwrite) an earlier export; never one holding anything else
    to = os.path.abspath(args.to)
    if os.path.islink(to):  # replaced, the link would go and the folder it names keep the old export
        raise UserError(f"{args.to} is a link; give the folder it names as --to")
    if os.path.exists(to) and not os.path.isdir(to):
        raise UserError(f"{args.to} is a file, not a folder; choose another --to")
    names = os.listdir(to) if os.path.isdir(to) else []
    if names and not args.overwrite:
        raise UserError(f"{args.to} is not empty; pass --overwrite to replace it, or choose another --to")
    if os.path.abspath(args.out_dir) == to or os.path.abspath(args.out_dir).startswith(to.rstrip("/") + "/"):
        raise UserError(f"--to={args.to} would replace the run it exports; choose another --to")
    foreign = [name for name in sorted(names) if not EXPORTED.fullmatch(name)
               or not os.path.isfile(os.path.join(to, name)) or os.path.islink(os.path.join(to, name))]
    if foreign:
        raise UserError(f"{args.to} holds {foreign[0]}, which export.py does not write: --overwrite replaces "
                        f"only an earlier export; choose another --to")


def temporary(make, to, mode):
    # this export's own name beside to, with the permissions any new folder or file gets (tempfile's are 0700/0600)
    try:
        made = make(prefix=os.path.basename(to) + ".", suffix=".export-tmp", dir=os.path.dirname(to))
    except OSError as e:
        raise UserError(written_nothing(to, e)) from None
    if isinstance(made, tuple):  # mkstemp's (handle, path)
        os.close(made[0])
        made = made[1]
    os.chmod(made, new_mode(mode))
    return made


def new_mode(mode):
    # the permissions a new file or folder of mode gets (this process's umask taken off)
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def on_disk(path):
    # path's bytes (a file, or a folder's files) on the disk before it takes its name, so that a power cut never
    # leaves a short file there; each readable as any new file is (huggingface_hub writes its safetensors 0600)
    for name in [path] + ([os.path.join(path, n) for n in os.listdir(path)] if os.path.isdir(path) else []):
        if os.path.isfile(name):
            os.chmod(name, new_mode(0o666))
        fd = os.open(name, os.O_RDONLY)  # (a folder's fsync keeps its names)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def undo(staging, old, to, made):
    # what a failed or stopped export leaves: its staging folder goes; the earlier export goes back where it was, or
    # goes (the new one took its place already); and a parent folder made for --to, where --to is not there
    shutil.rmtree(staging, ignore_errors=True)
    if os.path.exists(old) and not os.path.exists(to):
        os.replace(old, to)
    shutil.rmtree(old, ignore_errors=True)
    if made and not os.path.exists(to):
        shutil.rmtree(made, ignore_errors=True)


def stopped(signum, frame):
    # SIGTERM (a scheduler's, timeout's) as an exception, so that the cleanup (undo) removes the files made so far;
    # a second one is ignored, or it would cut the cleanup short
    signal.signal(signum, signal.SIG_IGN)
    raise SystemExit(f"export.py: stopped by {signal.Signals(signum).name}; its temporary files are removed, and an "
                     f"earlier export at --to is as it was")


def finishing():
    # the export is whole: from its renames on it finishes, a SIGTERM ignored (stopped's line would not be true)
    if signal.getsignal(signal.SIGTERM) is stopped:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def written_nothing(to, error):
    # the one line for an export the disk refused (ENOSPC, EDQUOT, EACCES, ...)
    return (f"cannot write --to={to} ({error.strerror or error}); nothing was left there: make room, or choose "
            f"another --to")


def main(argv=None):
    one_line_errors("export.py")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the run's folder")
    parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint in out_dir (ckpt_best.pt: best val loss; "
                        "the sharded folder of an FSDP run, ckpt/, is found by the same name)")
    parser.add_argument("--to", required=True, help="the folder to write, or a file NAME.gguf for llama.cpp")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the weights' dtype; auto: that of the folder the run began from, else float32 "
                        "(an --adapter's: float32)")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapter alone, in peft's layout")
    parser.add_argument("--data_dir", default=None, help="the dataset whose tokenizer to write (default: the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace --to if it is an earlier export (alone)")
    parser.add_argument("--device", default="auto", help="where a QLoRA run's nf4 or int8 base is quantized again to "
                        "be merged: 'auto' (a GPU if there is one), 'cpu', 'cuda', 'cuda:N', 'mps'")
    args = parser.parse_args(argv)
    if args.to.lower().endswith(".gguf"):
        return export_gguf(args)
    check_destination(args)
    made = make_parent(args.to)
    # built beside --to, renamed in: a failure leaves nothing half-written, --overwrite loses nothing until it is whole
    to = os.path.abspath(args.to)  # "." too: its temporary folders go beside it, not inside
    staging = temporary(tempfile.mkdtemp, to, 0o777)
    old = staging.removesuffix("-tmp") + "-old"  # this export's own names: another's, or a user's, stay as they are
    try:
        model, tokenizer, checkpoint = load_exported(args)
        base = checkpoint.get("pretrained") or ""
        ids = run_special_ids(tokenizer, base)
        if args.adapter:  # with its tokenizer: a run on conversations has its own chat template
            adapter_dtype = getattr(torch, "float32" if args.dtype == "auto" else args.dtype)  # (peft's: float32)
            write_adapter(model, checkpoint["pretrained"], staging, adapter_dtype)
        else:  # merged and cast
            dtype = getattr(torch, export_dtype(args.dtype, base))
            merge_lora(model, dtype, "cpu").to(dtype)
            save_pretrained(model, staging, ids=ids)
        note = write_tokenizer(tokenizer, checkpoint, staging, ids)
        if base and os.path.abspath(base) == to:
            raise UserError(f"--to={args.to} is the base model this run began from; choose another --to")
        on_disk(staging)
        finishing()
        if os.path.exists(to):
            os.replace(to, old)
        durable_replace(staging, to)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:  # model.py's plain ValueError too, a full disk, a Ctrl-C, a SIGTERM: nothing left
        undo(staging, old, to, made)
        if not isinstance(e, (ValueError, OSError)):
            raise
        raise UserError(str(e) if isinstance(e, ValueError) else written_nothing(args.to, e)) from None
    what = "a peft adapter" if args.adapter else "a Hugging Face model"
    print(f"wrote {what} to {args.to}" + (f" (tokenizer: {note})" if note else ""))
    held = held_base(checkpoint, base)
    if held and args.adapter:  # the adapters trained on that rounding; peft adds them to the folder's own weights
        print(f"note: the adapters trained on {base} held as {held}, and peft puts them on its own weights: a slightly "
              f"other model than the one trained and validated (export without --adapter for that one, merged)")
    elif held:
        print(f"(the adapters merged into {base} as the run held it: {held}"
              f"{', dequantized' if held in ('nf4', 'int8') else ''})")


def gguf_template(chat):
    # a chat run's template for llama.cpp, which renders it with the text of the file's BOS and EOS (its default where
    # it has none): the ones the data was rendered with set first, on a line of their own (trim_blocks takes it along)
    said = [f"{{% set {name} = {json.dumps(chat[name], ensure_ascii=False)} %}}"
            for name in ("bos_token", "eos_token") if isinstance(chat.get(name), str)]
    return "".join(said) + "\n" + chat["template"]


def export_gguf(args):
    # --to=NAME.gguf: one file, written beside its name and renamed into place when whole
    try:
        import gguf  # noqa: F401  (llama.cpp's library; optional, as GGUF is)
    except ImportError:
        raise UserError("writing GGUF needs llama.cpp's gguf package: pip install gguf") from None
    if args.adapter:
        raise UserError("a peft adapter is a folder, not a GGUF file: drop --adapter, or choose a --to without .gguf")
    if os.path.islink(args.to):  # replaced, the link would go and the file it names keep the old export
        raise UserError(f"{args.to} is a link; give the file it names as --to")
    if os.path.isdir(args.to):
        raise UserError(f"{args.to} is a folder, not a file; choose another --to")
    if os.path.exists(args.to) and not args.overwrite:
        raise UserError(f"{args.to} exists; pass --overwrite to replace it, or choose another --to")
    made, staging = make_parent(args.to), None
    try:
        staging = temporary(tempfile.mkstemp, os.path.abspath(args.to), 0o666)
        from lib.gguf_export import write_gguf
        model, tokenizer, checkpoint = load_exported(args)
        dtype = getattr(torch, export_dtype(args.dtype, base := checkpoint.get("pretrained") or ""))
        merge_lora(model, dtype, "cpu")  # added in float32, cast once: the matrices write_gguf writes, not copies
        chat = run_chat(checkpoint)
        template = chat["template"] if chat else None
        ids = run_special_ids(tokenizer, base)
        if chat:  # generation stops at the end of the assistant's turn, as in write_chat
            ids["eos_token_id"] = chat["end_of_turn_id"]
            template = gguf_template(chat)
        elif bases_tokenizer(tokenizer, base):  # a base's chat template holds where its tokenizer does
            config = os.path.join(base, "tokenizer_config.json")
            template = base_jinja(base) or (read_json(config).get("chat_template") if os.path.isfile(config) else None)
        unlike = write_gguf(model, tokenizer, staging, dtype, ids, template)
        on_disk(staging)
        finishing()
        durable_replace(staging, args.to)
    except ValueError as e:  # gguf's and model.py's plain ValueErrors too: one line all the same
        raise UserError(str(e)) from None
    except OSError as e:  # a full disk, a quota, permissions
        raise UserError(written_nothing(args.to, e)) from None
    finally:  # whatever stopped it, no half-written file stays behind, nor a folder made for it
        if staging and os.path.exists(staging):
            os.remove(staging)
        if made and not os.path.exists(args.to):
            shutil.rmtree(made, ignore_errors=True)
    print(f"wrote a GGUF model to {args.to}" + (f"\n{unlike}" if unlike else ""))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stopped)
    main()
