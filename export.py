"""
Export a training run as a Hugging Face folder that transformers, vLLM and llama.cpp's converter read:
config.json, model.safetensors (shards past 5 GB) and the tokenizer (tokenizer.json and
tokenizer_config.json), which encodes exactly as the data the model was trained on. A LoRA run is
merged into its base (W + alpha/rank B A, in fp32, then cast), or written alone as a peft adapter.

    python export.py --out_dir=out-finetune --to=models/finetuned
    python export.py --out_dir=out-finetune --ckpt=ckpt_best.pt --to=models/finetuned --dtype=bfloat16
    python export.py --out_dir=out-lora --to=adapters/mine --adapter    # peft: adapter_config.json + weights

Then: AutoModelForCausalLM.from_pretrained("models/finetuned") and AutoTokenizer.from_pretrained(...), or
PeftModel.from_pretrained(base_model, "adapters/mine").
"""

import argparse
import json
import os
import shutil
import sys

import torch

from checkpoint import load_run
from hf import read_json, save_pretrained
from lora import merge_lora, write_adapter
from tokenizer import durable_replace, hf_tokenizer_files, read_meta

# -----------------------------------------------------------------------------
# the folders: a whole model, or a LoRA adapter in peft's layout


def write_model(model, tokenizer, checkpoint, folder, dtype):
    # merged (a LoRA run's adapters folded into the base) and cast; returns a note on the tokenizer
    if dtype == "auto":  # the dtype the run began from, else the checkpoint's own (float32)
        dtype = folder_dtype(checkpoint.get("pretrained")) or "float32"
    merge_lora(model).to(getattr(torch, dtype))
    save_pretrained(model, folder, eos_token_id=tokenizer.eot_id)
    files, note = hf_tokenizer_files(tokenizer)
    for name, text in files.items():
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            f.write(text)
    # A base's own settings go along where they still hold: its generation defaults, and, when the data
    # was made with its very tokenizer, its tokenizer_config.json (chat template, special tokens).
    base = checkpoint.get("pretrained") or ""
    names = ["generation_config.json"]
    if tokenizer.kind == "huggingface" and read_text(os.path.join(base, "tokenizer.json")) == tokenizer.hf_json:
        names += ["tokenizer_config.json", "special_tokens_map.json"]
    for name in names:
        if os.path.isfile(os.path.join(base, name)):
            shutil.copyfile(os.path.join(base, name), os.path.join(folder, name))
    chat = read_meta(checkpoint["data_dir"]).get("chat")
    if chat and files:
        write_chat(folder, chat, tokenizer.eot_id)
    return note


def write_chat(folder, chat, eot_id):
    # A model trained on conversations: tokenizer_config.json gets the template it was trained with, whose
    # markers are special tokens (not split into text), and generation stops at the end of its turn, as in
    # sample.py --chat, in transformers' generate and in vLLM (generation_config.json's eos_token_id)
    config = read_json(os.path.join(folder, "tokenizer_config.json"))
    config.update(chat_template=chat["template"], split_special_tokens=False)
    for name in ("bos_token", "eos_token"):  # the tokens the template was rendered with, which it names
        if chat.get(name) and name not in config:
            config[name] = chat[name]
    generation = {}
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        generation = read_json(os.path.join(folder, "generation_config.json"))
    eos = generation.get("eos_token_id", [])
    eos = [i for i in (eos if isinstance(eos, list) else [eos]) if i is not None]
    generation["eos_token_id"] = [chat["end_of_turn_id"]] + [i for i in eos + [eot_id] if i != chat["end_of_turn_id"]]
    generation["eos_token_id"] = list(dict.fromkeys(generation["eos_token_id"]))
    for name, content in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        with open(os.path.join(folder, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def folder_dtype(pretrained):
    # the dtype a Hugging Face folder's config.json gives its weights; None without one
    if not pretrained:
        return None
    try:
        config = read_json(os.path.join(pretrained, "config.json"))
    except ValueError:
        return None
    return config.get("torch_dtype") or config.get("dtype")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", default="out", help="the run's folder")
    parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint in out_dir (ckpt_best.pt: best val loss; "
                        "the sharded folder of an FSDP run, ckpt/, is found by the same name)")
    parser.add_argument("--to", required=True, help="the folder to write")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="the weights' dtype; auto: that of the folder the run began from, else float32")
    parser.add_argument("--adapter", action="store_true", help="a LoRA run's adapter alone, in peft's layout")
    parser.add_argument("--data_dir", default=None, help="the dataset whose tokenizer to write (default: the run's)")
    parser.add_argument("--overwrite", action="store_true", help="replace --to if it holds anything")
    args = parser.parse_args(argv)
    if os.path.exists(args.to) and not os.path.isdir(args.to):
        sys.exit(f"export.py: {args.to} is a file, not a folder; choose another --to")
    if os.path.isdir(args.to) and os.listdir(args.to) and not args.overwrite:
        sys.exit(f"export.py: {args.to} is not empty; pass --overwrite to replace it, or choose another --to")
    if os.path.abspath(args.out_dir).startswith(os.path.abspath(args.to).rstrip("/") + "/") or \
            os.path.abspath(args.out_dir) == os.path.abspath(args.to):
        sys.exit(f"export.py: --to={args.to} would replace the run it exports; choose another --to")
    # Everything is written beside the destination first and renamed into place at the end, so that a
    # failure leaves no half-written folder and an --overwrite loses nothing until the new one is whole.
    staging = args.to.rstrip("/") + ".export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        # a LoRA run's base in fp32, so that the adapters merge into it in fp32 before the cast
        model, tokenizer, checkpoint = load_run(os.path.join(args.out_dir, args.ckpt), torch.float32, args.data_dir)
        if args.adapter:
            write_adapter(model, checkpoint["pretrained"], staging)
            note = None
        else:
            note = write_model(model, tokenizer, checkpoint, staging, args.dtype)
        base = checkpoint.get("pretrained")
        if base and os.path.abspath(base) == os.path.abspath(args.to):
            raise ValueError(f"--to={args.to} is the base model this run began from; choose another --to")
    except ValueError as e:
        shutil.rmtree(staging, ignore_errors=True)
        sys.exit(f"export.py: {e}")
    old = args.to.rstrip("/") + ".export-old"  # the folder replaced, kept until the new one is in place
    if os.path.exists(args.to):
        os.replace(args.to, old)
    durable_replace(staging, args.to)
    shutil.rmtree(old, ignore_errors=True)
    what = "a peft adapter" if args.adapter else "a Hugging Face model"
    print(f"wrote {what} to {args.to}" + (f" (tokenizer: {note})" if note else ""))


if __name__ == "__main__":
    main()
