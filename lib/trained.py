"""
A trained run read back for use (sample.py, eval.py, export.py): its model from a checkpoint of any layout, the
tokenizer of the data it was trained on, and the folder whose chat template it chats with.

    from lib.trained import load_run
    model, tokenizer, checkpoint = load_run("out/ckpt.pt")     # or out/ckpt_best.pt, or a sharded out/ckpt
"""

import json
import os

from lib.checkpoint import find_checkpoint
from lib.files import UserError, data_fingerprint, read_meta, tokenizer_fingerprint
from lib.hf import eos_ids, folder_splits_special, load_pretrained, special_ids
from lib.resume import load_checked, model_from_checkpoint
from lib.start import check_fused_ops, frozen_dtype, quantized_kind
from lib.tokenizer import bases_tokenizer, check_tokenizer, load_tokenizer, make_tokenizer
from lib.tokenizer_json import hf_tokenizer_files


def load_model(path, data_dir=None, base=True, device="cpu"):
    """ckpt.pt, or an FSDP run's sharded ckpt/ -> (model, checkpoint), on the CPU. A LoRA run's base is read as the run
    held it (start.frozen_dtype, quantized if nf4/int8: on device, a weight at a time, where the caller computes; the
    CPU takes hours at 70B), whatever dtype the caller computes in: its adapters trained on those weights; not base:
    its adapters alone, the base's weights on the meta device, never read (export.py --adapter).
    checkpoint["data_dir"] becomes where the data is now: data_dir, else where it was, else the config's."""
    if (found := find_checkpoint(path)) is None:
        best = " (a run writes ckpt_best once an evaluation after step 0 lowers its val loss)" if "ckpt_best" in \
            os.path.basename(path) else ""
        raise UserError(f"no checkpoint at {path} (train first: python train.py ..., or pass --out_dir){best}")
    path = found
    checkpoint = load_checked(path, {"model", "model_args", "config"}, mmap=True, verify="model")  # never the moments
    held = checkpoint["config"].get("lora_base_dtype", "auto")  # a LoRA run's base, as it trained
    # QLoRA's adapters on the base they trained on, quantized on device as it is read
    model = model_from_checkpoint(checkpoint, frozen_dtype(held, checkpoint["config"]["dtype"]), base,
                                  quantized_kind(held), device)
    check_fused_ops(model.config.use_kernels, device)  # (a model.py edited since, run by the unedited fused ops)
    candidates = [data_dir] if data_dir else [checkpoint.get("data_dir"), checkpoint["config"]["data_dir"]]
    found = next((d for d in candidates if d and os.path.isdir(d)), None)
    if found is None and data_dir:
        raise UserError(f"--data_dir={data_dir} is not a folder: give a prepared dataset's, or leave it out")
    if found is None:
        raise UserError(f"the model was trained on {candidates[-1]}, which is not here: its data is needed "
                         f"(restore it, or pass --data_dir)")
    # the data's tokenizer must be the run's (without a fingerprint, check_run_tokenizer compares the texts)
    trained_with = checkpoint.get("tokenizer_fingerprint")
    if trained_with and tokenizer_fingerprint(found, read_meta(found)) != trained_with and \
            not exports_tokenizer(found, checkpoint):
        fix = "leave --data_dir out" if data_dir else "pass --data_dir=DIR, a dataset prepared as the run's was"
        raise UserError(f"{found} was not prepared with the tokenizer {path} was trained with (its ids would mean "
                         f"other words): {fix}")
    checkpoint["trained_on"] = checkpoint.get("data_dir")  # where the run's own data was (check_run_tokenizer)
    checkpoint["data_dir"] = found  # where the data is now: its meta.json has the chat template, if any
    return model, checkpoint


def exports_tokenizer(data_dir, checkpoint):
    """Whether data_dir was prepared with the very tokenizer.json export.py writes for the run (prepare.py
    --tokenizer=EXPORT): the one made from the run's own data's tokenizer, where that data is here as it trained."""
    spec, ran_on = read_meta(data_dir).get("tokenizer"), checkpoint.get("data_dir")
    if not (isinstance(spec, dict) and spec.get("kind") == "huggingface" and ran_on and os.path.isdir(ran_on) and
            tokenizer_fingerprint(ran_on, read_meta(ran_on)) == checkpoint["tokenizer_fingerprint"]):
        return False
    try:
        ours, theirs = load_tokenizer(data_dir), load_tokenizer(ran_on)
    except UserError:  # (the caller's refusal is the line to say)
        return False
    exported = hf_tokenizer_files(theirs)[0].get("tokenizer.json")
    return ours.kind == "huggingface" and exported is not None and json.loads(exported) == json.loads(ours.hf_json) \
        and (ours.vocab_size, ours.eot_id, ours.bos_id) == (theirs.vocab_size, theirs.eot_id, theirs.bos_id)


def check_run_tokenizer(data_dir, checkpoint, model_vocab):
    """UserError unless another dataset than the run's (--data_dir) was made with the run's tokenizer: its ids
    would mean other words. Compared with the run's own data, else the folder it began from, if either is here."""
    if checkpoint.get("tokenizer_fingerprint"):  # compared already, exactly (load_model)
        return
    places = (checkpoint.get("trained_on"), checkpoint["config"]["data_dir"])
    reference = next((d for d in places if d and os.path.isdir(d)), None) or checkpoint.get("pretrained")
    if not reference or not os.path.isdir(reference) or os.path.abspath(reference) == os.path.abspath(data_dir):
        return
    fix = f"leave --data_dir out (the run's own data: {reference}), or prepare it with the run's tokenizer"
    check_tokenizer(data_dir, read_meta(data_dir), reference, model_vocab, fix)


def load_run(path, data_dir=None, base=True, device="cpu"):
    """load_model's (model, tokenizer, checkpoint): the tokenizer lives with the data the model was trained on."""
    model, checkpoint = load_model(path, data_dir, base, device)
    found = checkpoint["data_dir"]
    try:
        tokenizer = load_tokenizer(found)
    except (KeyError, TypeError) as e:
        raise UserError(f"cannot read the tokenizer in {found} ({type(e).__name__}: {e}); re-run prepare.py")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"{found}'s tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                         f"{model.config.vocab_size}: it is not the data this model was trained on")
    if data_dir:
        check_run_tokenizer(data_dir, checkpoint, model.config.vocab_size)
    return model, tokenizer, checkpoint


def load_folder_or_run(folder, path, dtype, data_dir, use, device="cpu"):
    """(model, tokenizer, None) of a Hugging Face folder, else load_run's (for device); use: what the folder's tokenizer
    encodes."""
    if not folder:
        return load_run(path, data_dir, device=device)
    if not os.path.isdir(folder):
        raise UserError(f"--model={folder} is no folder: name a Hugging Face model's folder (config.json, its "
                        f"*.safetensors and tokenizer.json)")
    if data_dir:  # the folder's own tokenizer.json is the one its ids mean
        raise UserError(f"--data_dir is a run's dataset, and {folder} brings its own tokenizer: leave --data_dir out")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        raise UserError(f"{folder} has no tokenizer.json to encode {use} with")
    model = load_pretrained(folder, dtype)
    check_fused_ops(model.config.use_kernels, device)
    return model, make_tokenizer(folder, None), None


def chat_folder(checkpoint, tokenizer):
    """The folder whose chat template a run chats with, as in export.py: the one it began from where the data was
    made with its very tokenizer.json, not from conversations (a text fine-tune of a chat model); else the data's."""
    data_dir, base = checkpoint["data_dir"], checkpoint.get("pretrained")
    return data_dir if run_chat(checkpoint) or not bases_tokenizer(tokenizer, base) else base


def chat_stops(folder, tokenizer, end_of_turn, checkpoint=None):
    """The ids a --chat reply ends at, those of the run's export (transformers' generate stops at its
    generation_config.json's): end_of_turn and folder's end-of-text ids; a chat run's base's and its end-of-text too."""
    stops = [end_of_turn, *eos_ids(folder, tokenizer)]
    if checkpoint is not None and run_chat(checkpoint):  # (export.write_chat)
        base = checkpoint.get("pretrained")
        stops += [*(eos_ids(base, tokenizer) if base else []), tokenizer.eot_id]
    return list(dict.fromkeys(i for i in stops if i is not None))


def run_special_ids(tokenizer, base):
    """config.json's special token ids for the run's export: a base's own, else the data's BOS (if any) and
    end-of-text as eos and pad. A base's config.json without an eos (as transformers 5 saves a Qwen3Config()) gets the
    one its tokenizer_config.json, else generation_config.json names, as llama.cpp's converter and transformers read."""
    if base:
        ids = special_ids(base)
        if ids.get("eos_token_id") is None:
            said = eos_ids(base, tokenizer) if bases_tokenizer(tokenizer, base) else []
            ids["eos_token_id"] = said[0] if said else tokenizer.eot_id
        return ids
    if tokenizer.eot_id is None:  # nanoGPT's characters have no end-of-text
        return {}
    bos = {"bos_token_id": tokenizer.bos_id} if tokenizer.bos_id is not None else {}
    return {**bos, "eos_token_id": tokenizer.eot_id, "pad_token_id": tokenizer.eot_id}


def exported_eos_ids(checkpoint, tokenizer):
    """The ids that end a text in the run's export, as transformers reads them there (hf.eos_ids: tokenizer_config's
    eos_token, lm_eval's end of text, then generation_config.json's), as export.write_tokenizer writes them: a base's
    tokenizer_config.json carried where the data was made with its tokenizer (else its own, eos_token the end of
    text), its generation_config.json carried (else run_special_ids'); write_chat's eos_token first, the end of turn
    before the rest and the end of text after them."""
    base, chat = checkpoint.get("pretrained") or "", run_chat(checkpoint)
    carried = [name for name in ("tokenizer_config.json", "generation_config.json")
               if base and os.path.isfile(os.path.join(base, name))]
    first = eos_ids(base, tokenizer, ["tokenizer_config.json"]) \
        if "tokenizer_config.json" in carried and bases_tokenizer(tokenizer, base) else [tokenizer.eot_id]
    written = run_special_ids(tokenizer, base).get("eos_token_id")
    then = eos_ids(base, tokenizer, ["generation_config.json"]) if "generation_config.json" in carried else \
        written if isinstance(written, list) else [written]
    if chat:
        first = [tokenizer.special_tokens().get(chat["eos_token"])] if chat.get("eos_token") else first
        then = [chat["end_of_turn_id"], *then, tokenizer.eot_id]
    return list(dict.fromkeys(i for i in [*first, *then] if i is not None)) or None


def splits_special(checkpoint, tokenizer):
    """Whether the run's export reads a special token's spelling in a text as text (split_special_tokens in the
    tokenizer_config.json export.py writes): not a chat run's (its markers are tokens); a run on its base's very
    tokenizer.json as the base's tokenizer_config.json says, which the export carries; any other (or a base without
    that file) as prepare.py read its documents, as text."""
    base = checkpoint.get("pretrained")
    if run_chat(checkpoint):
        return False
    return not bases_tokenizer(tokenizer, base) or folder_splits_special(base, missing=True)


def run_chat(checkpoint):
    """meta.json's chat entry of the run's data folder, or None; UserError if since prepared with another template."""
    data_dir = checkpoint["data_dir"]
    meta = read_meta(data_dir)
    trained_with = checkpoint.get("data_fingerprint", {}).get("chat")
    if trained_with and data_fingerprint(meta)["chat"] != trained_with:
        raise UserError(f"{data_dir} was prepared with another chat template than the run's conversations (prepared "
                        f"again since): prepare it with the run's --chat_template, or pass --data_dir=DIR, a dataset "
                        f"prepared so")
    return meta.get("chat")
