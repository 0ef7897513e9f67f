"""
Sample from a trained model: its checkpoint, and the tokenizer of the data it was trained on; or from
a Hugging Face model folder (Llama, Mistral, Qwen2, Qwen3) with the folder's own tokenizer.json.

    python sample.py --out_dir=out-small --start="import " --num_samples=2 --max_new_tokens=200
    python sample.py --out_dir=out-shakespeare-char --start=FILE:prompt.txt --temperature=0.8
    python sample.py --model=models/Qwen3-0.6B --start="The capital of France is" --temperature=0

A model trained on conversations (or a folder with a chat template) chats: --chat renders the conversation with
its template and answers until its end-of-turn token; with --start it answers that one message and exits.

    python sample.py --out_dir=out-sft --chat --system="You are terse."     # type a message, empty line to end
                                                                  # (between """ and """: a message of several lines)
    python sample.py --model=models/Qwen3-0.6B --chat --start="Name a prime." --temperature=0
"""

import argparse
import os
import sys
from contextlib import nullcontext

import torch

from lib.chat import ChatFormat, find_template
from lib.files import UserError, one_line_errors, read_meta
from lib.parallel import pick_device
from lib.settings import SAMPLING, check_ranges
from lib.trained import chat_folder, chat_stops, load_folder_or_run

one_line_errors("sample.py")
MAX_PROMPT = 1 << 20  # characters of a --start=FILE: or --system=FILE: text
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out_dir", default="out", help="folder holding the checkpoint")
parser.add_argument("--ckpt", default="ckpt.pt", help="checkpoint in out_dir (ckpt_best.pt: best val loss; the "
                    "sharded folder of an FSDP run, ckpt/, is found by the same name)")
parser.add_argument("--model", default=None, help="a Hugging Face model folder to sample instead of a checkpoint")
parser.add_argument("--init_from", default="resume", help="nanoGPT's flag: 'resume' (out_dir's checkpoint, the "
                    "default) or a Hugging Face model folder (as --model)")
parser.add_argument("--start", default=None, help="prompt text, or FILE:path to read it from a file (default: a "
                    "newline; with --chat: read messages from the terminal)")
parser.add_argument("--chat", action="store_true", help="chat with the model through its chat template")
parser.add_argument("--system", default=None, help="with --chat: the system prompt, or FILE:path to read it from")
parser.add_argument("--num_samples", type=int, default=None, help="samples of the prompt (default 3; not with --chat)")
parser.add_argument("--max_new_tokens", type=int, default=500)
parser.add_argument("--temperature", type=float, default=0.8, help="<1 is surer, >1 more varied, 0 greedy")
parser.add_argument("--top_k", type=int, default=200, help="sample only among the k likeliest tokens (0: among all)")
parser.add_argument("--top_p", type=float, default=None, help="sample only among tokens whose mass reaches p")
parser.add_argument("--seed", type=int, default=1337)
parser.add_argument("--data_dir", default=None, help="the dataset whose tokenizer to use (default: the model's own)")
parser.add_argument("--device", default="auto", help="'auto', 'cpu', 'cuda', 'mps'")
parser.add_argument("--dtype", default="auto", help="'float32', 'bfloat16', 'float16'; auto: bf16 on CUDA")
args = parser.parse_args()
if args.system is not None and not args.chat:  # else sampled without it, and nothing said
    raise UserError("--system is the system prompt of --chat: add --chat, or leave --system out")
if args.num_samples is not None and args.chat:  # else one reply, and nothing said
    raise UserError("--num_samples is plain sampling's: --chat gives one reply to each message; leave it out")
args.num_samples = 3 if args.num_samples is None else args.num_samples


def utf8(text, what):
    # text, or UserError where it holds bytes that were not UTF-8 (an argument's or a terminal's: lone surrogates,
    # which no tokenizer reads)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not UTF-8 text: give it in UTF-8") from None
    return text


def marker_in(chat, text, what):
    # a special token's spelling in text, which the chat's encoding would read as the token (a turn closed early, a
    # role made up), refused in one line as prepare.py refuses it in a conversation; else None
    held = chat.special_in(text)
    return held and f"{what} holds {held}, a special token of the tokenizer, as text (it would be read as the " \
                    f"token): leave it out"


for name in ("start", "system"):
    if getattr(args, name) is not None and not getattr(args, name).startswith("FILE:"):  # (a file's name: any bytes)
        utf8(getattr(args, name), f"--{name}")

# -----------------------------------------------------------------------------
# the checkpoint, the model and the tokenizer

if args.init_from != "resume":  # nanoGPT's way to name what to sample: a folder is our --model
    if not os.path.isdir(args.init_from):
        raise UserError(f"--init_from={args.init_from} is not 'resume' or a Hugging Face model folder (nanoGPT's "
                        f"GPT-2 weights are not this model's: sample a run with --out_dir, a folder with --model)")
    if args.model and os.path.realpath(args.model) != os.path.realpath(args.init_from):
        raise UserError(f"--model={args.model} and --init_from={args.init_from} name two folders: give one")
    args.model = args.model or args.init_from
if args.model and (args.out_dir, args.ckpt) != ("out", "ckpt.pt"):  # (else the run's checkpoint, left unsaid)
    raise UserError("--out_dir and --ckpt name a run's checkpoint, --model a folder to sample instead: give one")
device, dtype = pick_device(args.device, args.dtype)
check_ranges(vars(args), SAMPLING, "--")  # as a run's settings are (else a traceback, or the least likely tokens)

try:  # a plain ValueError that comes out of the loaders (sizes GPTConfig refuses) is said in one line too
    model, tokenizer, checkpoint = load_folder_or_run(args.model, os.path.join(args.out_dir, args.ckpt),
                                                      getattr(torch, dtype), args.data_dir, "the prompt", device)
except ValueError as e:
    raise UserError(str(e)) from None
folder = args.model or chat_folder(checkpoint, tokenizer)  # where the chat template is
model.eval().to(device)
autocast = nullcontext() if dtype == "float32" else torch.autocast(device.split(":")[0], dtype=getattr(torch, dtype))
sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                vocab=min(tokenizer.vocab_size, model.config.vocab_size))
# it attended within documents: end-of-text begins one (as eval.py); on conversations (masks) only the one that ends
# an example did, which a generation cannot tell from one that ends a turn: none does
if checkpoint is not None and checkpoint["config"].get("doc_mask") and tokenizer.eot_id is not None and not args.chat \
        and not read_meta(checkpoint["data_dir"]).get("masks"):
    sampling["document"] = tokenizer.eot_id
torch.manual_seed(args.seed)


def given_text(value, what):
    # --start's or --system's text: as given, or FILE:path's, read in bounded memory (the model sees its last
    # block_size tokens alone, and a huge text would take gigabytes to encode)
    if value is None or not value.startswith("FILE:"):
        return value
    try:
        with open(os.path.expanduser(value[5:]), encoding="utf-8-sig", newline="") as f:  # (~ after FILE: is ours)
            text = f.read(MAX_PROMPT + 1)
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the {what} file {value[5:]} ({e})") from None
    if len(text) > MAX_PROMPT:
        raise UserError(f"the {what} file {value[5:]} is longer than {MAX_PROMPT:,} characters: give the part that "
                        f"matters (the model sees its last {model.config.block_size} tokens)")
    return text


start = given_text(args.start, "prompt") if args.start is not None or args.chat else "\n"
system = given_text(args.system, "system prompt")


def known(ids, what):
    # ids, or UserError where one is past the model's embeddings (a folder whose tokenizer has tokens it was not
    # given rows for: an index error in the first forward)
    past = next((i for i in ids if i >= model.config.vocab_size), None)
    if past is not None:
        raise UserError(f"{what} holds {tokenizer.decode([past])!r}, token {past}, which the model has no embedding "
                        f"for (its vocab_size is {model.config.vocab_size}): leave it out")
    return ids


def reply(messages):
    # the model's next turn: the conversation rendered with the generation prompt, sampled until end-of-turn (or an
    # end-of-text, where its export's generation_config.json has transformers' generate stop: trained.chat_stops). Past
    # block_size the window would begin inside a turn, the system prompt cut off: the oldest exchanges are left out
    # (the system prompt and the last message stay) until it fits with room for the reply (a quarter window at least)
    system = messages[:1] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    while True:
        ids = tokenizer.encode_chat(chat.render(system + turns, add_generation_prompt=True), [])[0].tolist()
        if len(ids) + min(args.max_new_tokens, model.config.block_size // 4) <= model.config.block_size or \
                len(turns) <= 1:
            break
        turns = turns[2:]  # a user message and its reply
    if len(ids) > model.config.block_size:  # (one message, or the system prompt, past it: generate slides)
        print(f"note: the conversation is {len(ids)} tokens, of which the model sees the last "
              f"{model.config.block_size} (its block_size): {'the system prompt' if system else 'its beginning'} is "
              f"cut off", file=sys.stderr)
    x = torch.tensor(known(ids, "the conversation"), dtype=torch.long, device=device)[None, :]
    with autocast:
        y = model.generate(x, args.max_new_tokens, stop=stops, **sampling)[0, len(ids):].tolist()
    return tokenizer.decode(y[:next((i for i, t in enumerate(y) if t in stops), len(y))]).strip()


if args.chat:  # one reply to --start, or a conversation typed in the terminal
    try:
        learned = tokenizer.eot_id is not None and find_template(folder)[1] != "built-in"
        if learned:  # (else it never learned one: a template of ours would only confuse it)
            chat = ChatFormat.for_tokenizer(folder, tokenizer.special_tokens(), tokenizer.decode([tokenizer.eot_id]))
            stops = chat_stops(folder, tokenizer, tokenizer.special_tokens()[chat.end_of_turn], checkpoint)
    except (ValueError, OSError, KeyError) as e:
        raise UserError(f"cannot chat with this model's template ({e})") from None
    if not learned:
        raise UserError(f"--chat needs a model trained on conversations, or begun from a folder with a chat template: "
                        f"{folder} has no chat template; sample without --chat")
    if start is not None and not start.strip():
        raise UserError("--start is empty: give the message to answer (or leave --start out to type messages)")
    if system and (refused := marker_in(chat, system, "--system")):
        raise UserError(refused)
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            text = start if start is not None else input("> ")
            if start is None and text.startswith('"""'):  # a message of several lines (pasted), up to a closing """
                text = text[3:]
                while not text.endswith('"""'):
                    text += "\n" + input("... ")
                text = text[:-3]
            text = utf8(text, "the message")  # (checked whole: a bad line leaves the rest of a paste in it)
        except (UnicodeDecodeError, UserError):  # typed: said, and asked again
            print("the message is not UTF-8 text: type it in UTF-8", file=sys.stderr, flush=True)
            continue
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt ends the chat
            print()
            break
        if not text.strip():
            break
        refused = marker_in(chat, text, "--start" if start is not None else "the message")
        if refused and start is not None:
            raise UserError(refused)
        if refused:  # typed: said, and asked again
            print(refused, file=sys.stderr, flush=True)
            continue
        messages.append({"role": "user", "content": text})
        # a ValueError is said in one line; a conversation past block_size raises none (generate slides its window)
        try:
            messages.append({"role": "assistant", "content": reply(messages)})
        except ValueError as e:
            raise UserError(str(e)) from None
        except KeyboardInterrupt:  # Ctrl-C while it replies ends the chat too (--start's: unanswered, as a failure)
            print()
            if start is not None:
                sys.exit(130)
            break
        print(messages[-1]["content"], flush=True)
        if start is not None:
            break
    sys.exit(0)

try:  # with the BOS the tokenizer begins a text with (Llama 3's), as every training document began
    ids = tokenizer.encode(start, bos=True)
except ValueError as e:  # e.g. a character the char vocabulary lacks
    if args.start is None:  # (the data had no newline)
        raise UserError("the default prompt, a newline, is not in this model's vocabulary: give one, --start=TEXT") \
            from None
    raise UserError(f"the prompt cannot be encoded: {e}") from None
if not known(ids, "the prompt"):
    raise UserError("the prompt encodes to no tokens (give a non-empty --start)")
if len(ids) > model.config.block_size:  # generate slides its window over it
    print(f"note: the prompt is {len(ids)} tokens, of which the model sees the last {model.config.block_size} "
          f"(its block_size)", file=sys.stderr)

# -----------------------------------------------------------------------------
# generate

x = torch.tensor(ids, dtype=torch.long, device=device)[None, :]  # (1, T)
skip = int(tokenizer.bos_id is not None)
if args.temperature < 1e-5 and args.num_samples > 1:  # greedy (model.generate): the same text every time
    print(f"note: --temperature=0 is greedy, so its {args.num_samples} samples would be identical: printing one",
          file=sys.stderr)
    args.num_samples = 1
try:
    with autocast:
        for _ in range(args.num_samples):
            y = model.generate(x, args.max_new_tokens, **sampling)
            print(tokenizer.decode(y[0, skip:].tolist()))  # the prompt and its continuation, without the BOS
            print("---------------", flush=True)  # each sample as it comes
except KeyboardInterrupt:  # Ctrl-C: the samples printed so far stand, no traceback
    print()
    sys.exit(130)
