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

from tokenizer import hf_tokenizer_files

# -----------------------------------------------------------------------------
# a run's checkpoint -> the model and the tokenizer of its data (sample.py reads runs this way too)


def load_run(path, base_dtype=None, data_dir=None):
    """out_dir/ckpt.pt -> (model, tokenizer, checkpoint), on the CPU; or the sharded folder out_dir/ckpt/ of
    an FSDP run, whichever is newer (see find_checkpoint). A LoRA run's frozen base is read in
    base_dtype (None: its folder's). The tokenizer lives with the data the model was trained on:
    data_dir, else where that data was then, else where the run's config says. ValueError with one
    line for what is missing or damaged."""
    from model import GPT, find_checkpoint, load_checkpoint
    from tokenizer import load_tokenizer
    found = find_checkpoint(path)
    if found is None:
        raise ValueError(f"no checkpoint at {path} (train first: python train.py ..., or pass --out_dir)")
    path = found
    checkpoint = load_checkpoint(path, mmap=True)  # the weights are read, the optimizer's moments never
    if not isinstance(checkpoint, dict) or {"model", "model_args", "config"} - checkpoint.keys():
        raise ValueError(f"{path} is not a checkpoint of train.py (it lacks its model, model_args or config)")
    model = GPT.from_checkpoint(checkpoint, base_dtype)
    candidates = [data_dir] if data_dir else [checkpoint.get("data_dir"), checkpoint["config"]["data_dir"]]
    found = next((d for d in candidates if d and os.path.isdir(d)), None)
    if found is None:
        raise ValueError(f"the model was trained on {candidates[-1]}, which is not here: its tokenizer is needed "
                         f"(restore it, or pass --data_dir)")
    try:
        tokenizer = load_tokenizer(found)
    except (KeyError, TypeError) as e:
        raise ValueError(f"cannot read the tokenizer in {found} ({type(e).__name__}: {e}); re-run prepare.py")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"{found}'s tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{model.config.vocab_size}: it is not the data this model was trained on")
    return model, tokenizer, checkpoint


# -----------------------------------------------------------------------------
# the folders: a whole model, or a LoRA adapter in peft's layout


def write_model(model, tokenizer, checkpoint, folder, dtype):
    # merged (a LoRA run's adapters folded into the base) and cast; returns a note on the tokenizer
    import torch
    if dtype == "auto":  # the dtype the run began from, else the checkpoint's own (float32)
        dtype = folder_dtype(checkpoint.get("pretrained")) or "float32"
    model.merge_lora().to(getattr(torch, dtype))
    model.save_pretrained(folder, eos_token_id=tokenizer.eot_id)
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
    return note


def read_text(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def folder_dtype(pretrained):
    try:
        with open(os.path.join(pretrained, "config.json")) as f:
            config = json.load(f)
        return config.get("torch_dtype") or config.get("dtype")
    except (TypeError, OSError, ValueError):
        return None


def write_adapter(model, checkpoint, folder):
    # peft's layout: adapter_config.json, and lora_A/lora_B of each adapted module under transformers' names
    from safetensors.torch import save_file

    from model import LORA_TARGETS
    c = model.config
    if not c.lora_rank:
        raise ValueError("--adapter exports a LoRA run's adapters, and this run trained every weight (leave it out)")
    tensors = {}
    for i, name, linear in model.lora_projections():
        if getattr(linear, "lora", None) is not None:
            module = f"base_model.model.model.layers.{i}.{LORA_TARGETS[name]}"
            tensors[f"{module}.lora_A.weight"] = linear.lora.A.detach().contiguous()
            tensors[f"{module}.lora_B.weight"] = linear.lora.B.detach().contiguous()
    targets = [LORA_TARGETS[t].split(".")[-1] for t in c.lora_targets.split(",")]
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": checkpoint["pretrained"],
              "r": c.lora_rank, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
              "target_modules": sorted(targets), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "inference_mode": True, "modules_to_save": None, "init_lora_weights": True}
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


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
    import torch
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
            write_adapter(model, checkpoint, staging)
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
    os.replace(staging, args.to)
    shutil.rmtree(old, ignore_errors=True)
    what = "a peft adapter" if args.adapter else "a Hugging Face model"
    print(f"wrote {what} to {args.to}" + (f" (tokenizer: {note})" if note else ""))


if __name__ == "__main__":
    main()
