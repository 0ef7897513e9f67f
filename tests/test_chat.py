"""chat.py with tokenizer.py and prepare.py: conversations rendered by the chat templates of Qwen3, Llama-3 and
Mistral (written here after the real ones) give transformers' text and token ids, train each assistant's reply
and the token closing it and nothing else, become masked datasets, and cannot reach Python from the sandbox.
Nothing is downloaded: each tokenizer is a tiny byte-level BPE made here.
Run: python -m pytest -q tests/test_chat.py"""

import json
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from lib import chat  # noqa: E402
import prepare  # noqa: E402
from lib.files import END, UserError  # noqa: E402
from lib.tokenizer import load_tokenizer, make_tokenizer  # noqa: E402

# -----------------------------------------------------------------------------
# three templates, after the ones their models' tokenizer_config.json hold

# Qwen3's: ChatML turns, tools in the system turn, and a think block before the reply of an assistant turn that
# follows the last user query (an empty one when the reply has none).
QWEN3 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Meta-Llama-3-8B-Instruct's: the BOS written by the template itself, each turn closed by <|eot_id|>.
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

# Mistral-7B-Instruct-v0.2's: [INST] ... [/INST] answer</s>, the system prompt folded into the first user turn,
# and roles that must alternate.
MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

# name -> the template, tokenizer_config.json's bos/eos, the special tokens (the end-of-text our tokenizer.py looks
# for among them), added tokens that are not special, the token closing an assistant's turn
STYLES = {
    "qwen3": dict(template=QWEN3, bos=None, eos="<|im_end|>", end_of_turn="<|im_end|>",
                  special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], plain=["<think>", "</think>"]),
    "llama3": dict(template=LLAMA3, bos="<|begin_of_text|>", eos="<|eot_id|>", end_of_turn="<|eot_id|>",
                   special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                            "<|eot_id|>"], plain=[]),
    "mistral": dict(template=MISTRAL, bos="<s>", eos="</s>", end_of_turn="</s>",
                    special=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"], plain=[]),
}

# A system prompt and three exchanges; replies of several words, so that their tokens are not the prompts'.
MESSAGES = [
    {"role": "system", "content": "You are a terse geography tutor."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, on the Tiber."},
    {"role": "user", "content": "Which river runs through Berlin?"},
    {"role": "assistant", "content": "The Spree runs through Berlin."},
]
REPLIES = [m["content"] for m in MESSAGES if m["role"] == "assistant"]

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris, Rome and Berlin are capitals; the Tiber and the Spree "
    "are rivers. What is the capital of France? Which river runs through it? You are a terse tutor of geography. "
    "Questions and answers, users and assistants, systems and prompts: a conversation has turns.\n"
    "def main():\n    return 42  # a comment, with numbers 0123456789 and punctuation !?;:'\"()[]{}\n"
)


def make_folder(folder, style):
    """A tiny byte-level BPE with the style's special tokens, as tokenizer.json + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=spec["special"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS] * 4, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["plain"]])
    if spec["bos"]:  # as the real ones do, which add the BOS when asked for special tokens: the template has it
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": spec["template"],
              "bos_token": spec["bos"], "eos_token": spec["eos"], "model_max_length": 4096}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request, tmp_path_factory):
    """(name, folder, transformers' tokenizer, ours) for each template."""
    folder = make_folder(tmp_path_factory.mktemp(request.param), request.param)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    return request.param, folder, theirs, make_tokenizer(str(folder), None)


def chat_format(folder, ours, train_on="assistant"):
    eot = ours.decode([ours.eot_id])
    return chat.ChatFormat.for_tokenizer(str(folder), ours.special_tokens(), eot, train_on)


def their_ids(theirs, messages, **kwargs):
    out = theirs.apply_chat_template(messages, tokenize=True, **kwargs)
    if not isinstance(out, list):  # transformers 5: a BatchEncoding
        out = out["input_ids"]
    return list(out)


def trained_runs(ours, ids, mask):
    """The decoded stretches of trained tokens, in order."""
    runs, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m == 1 and start is None:
            start = i
        elif m != 1 and start is not None:
            runs.append(ours.decode(ids[start:i].tolist()))
            start = None
    return runs

# -----------------------------------------------------------------------------
# 1. the text and the token ids are transformers'


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_and_ids_match_transformers(style, add_generation_prompt):
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)
    conversations = [MESSAGES, MESSAGES[:-1], MESSAGES[1:]]  # ending with a reply or a question; no system prompt
    for messages in conversations:
        text = fmt.render(messages, add_generation_prompt=add_generation_prompt)
        assert text == theirs.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt), name
        ids, mask = ours.encode_chat(text, [])
        assert ids.tolist() == their_ids(theirs, messages, add_generation_prompt=add_generation_prompt), name
        assert mask.tolist() == [0] * len(ids)


def test_special_tokens_are_single_tokens(style):
    name, folder, theirs, ours = style
    text = chat_format(folder, ours).render(MESSAGES)
    ids = ours.encode_chat(text, [])[0].tolist()
    specials = ours.special_tokens()
    eot = specials[STYLES[name]["end_of_turn"]]
    assert ids.count(eot) == len(REPLIES) + (name != "mistral") * (len(MESSAGES) - len(REPLIES))
    assert ours.decode(ids) == text  # nothing lost, nothing added


@pytest.mark.parametrize("style", ["llama3"], indirect=True)
def test_llama3_bos_once(style):
    name, folder, theirs, ours = style
    bos = ours.special_tokens()["<|begin_of_text|>"]
    assert theirs.encode("Hi")[0] == bos  # the post-processor adds one, as the real one does
    text = chat_format(folder, ours).render(MESSAGES)
    assert text.count("<|begin_of_text|>") == 1
    ids = ours.encode_chat(text, [])[0].tolist()
    assert ids.count(bos) == 1 and ids[0] == bos
    assert their_ids(theirs, MESSAGES).count(bos) == 1

# -----------------------------------------------------------------------------
# 2. masks: what the model is trained to write


def test_assistant_mask_is_replies_and_end_of_turn(style):
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)
    end = STYLES[name]["end_of_turn"]
    assert fmt.end_of_turn == end
    for messages in (MESSAGES, MESSAGES[1:], MESSAGES[1:3]):
        record = fmt.record({"messages": messages})
        ids, mask = ours.encode_chat(record.text, record.spans)
        assert ids.tolist() == their_ids(theirs, messages)
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        # a reply after a space ("[/INST] Paris") starts with a token holding the space; Qwen3's last turn
        # begins with the (empty) think block its template writes, which the model learns to write too
        runs = [run.lstrip(" ") for run in trained_runs(ours, ids, mask)]
        if name == "qwen3":
            assert runs[-1].startswith(THINK) and not any(run.startswith(THINK) for run in runs[:-1])
            runs[-1] = runs[-1].removeprefix(THINK)
        assert runs == [reply + end for reply in replies], name
        untrained = ours.decode(ids[mask == 0].tolist())
        for m in messages:
            if m["role"] != "assistant":
                assert m["content"] in untrained


def test_qwen3_reasoning_of_earlier_turns_is_dropped_and_their_replies_trained(style):
    # Qwen3's template keeps the think block of the last turn only: an earlier turn's reply is found without it
    name, folder, theirs, ours = style
    if name != "qwen3":
        pytest.skip("Qwen3's template")
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>two and two</think>4"},
                {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>three twice</think>6"}]
    record = chat_format(folder, ours).record({"messages": messages})
    assert "two and two" not in record.text and "three twice" in record.text
    ids, mask = ours.encode_chat(record.text, record.spans)
    runs = trained_runs(ours, ids, mask)
    assert runs == ["4<|im_end|>", "<think>\nthree twice\n</think>\n\n6<|im_end|>"]  # the last one's reasoning too


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_a_conversation_with_a_lone_surrogate_is_skipped_and_listed(style, tmp_path):
    # "\ud83d" alone in JSON is no text a tokenizer reads: the record is skipped and listed, as a text one would be
    name, folder, theirs, ours = style
    records = [{"messages": MESSAGES[1:3]}, {"messages": [{"role": "user", "content": "Hi \ud83d"},
                                                          {"role": "assistant", "content": "Hello"}]}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         "--val_fraction=0"])
    assert meta["train"]["documents"] == 1 and meta["bad_records"]["count"] == 1
    assert "invalid unicode (lone surrogate)" in meta["bad_records"]["examples"][0]


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
@pytest.mark.parametrize("key", ["reasoning_content", "thinking", "reasoning"])
def test_a_replys_reasoning_under_any_of_its_names_is_rendered_as_transformers_does(style, key):
    # transformers gives a template a message's reasoning as reasoning_content (Qwen3's read it) and thinking
    # (gpt-oss's), whichever name the data keeps it under
    name, folder, theirs, ours = style
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", key: "two plus two"}]
    text = chat_format(folder, ours).render(messages)
    assert text == theirs.apply_chat_template(messages, tokenize=False) and "two plus two" in text


# Mistral v0.3's: the system prompt goes into the last user turn, so the conversation before a reply is written
# otherwise when it ends there
MISTRAL_V03 = """{%- if messages[0]["role"] == "system" %}{%- set system_message = messages[0]["content"] %}
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- endif %}
{%- endfor %}"""


@pytest.mark.parametrize("name,template,messages,trained", [
    # a reply whose words are in the reasoning before it: found backwards from its end-of-turn
    ("qwen3", None, [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>2+2 = 4</think>4"}],
     ["<think>\n2+2 = 4\n</think>\n\n4<|im_end|>"]),
    ("qwen3", None, [{"role": "user", "content": "A preposition?"}, {"role": "assistant", "content": "in"}],
     ["<think>\n\n</think>\n\nin<|im_end|>"]),
    # a user message holding the reply, under a template that writes the turns before a reply otherwise
    ("mistral", MISTRAL_V03, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say Paris."},
                              {"role": "assistant", "content": "Paris."}], ["Paris.</s>"]),
    ("mistral", MISTRAL_V03, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Capital?"},
                              {"role": "assistant", "content": "Paris."}], ["Hello</s>", "Paris.</s>"]),
])
def test_replies_are_found_where_their_words_also_stand_elsewhere(name, template, messages, trained):
    spec = STYLES[name]
    fmt = chat.ChatFormat(template or spec["template"], name, spec["special"], spec["eos"], "assistant", spec["bos"])
    record = fmt.record({"messages": messages})
    assert [record.text[a:b].lstrip(" ") for a, b in record.spans] == trained


THINK = "<think>\n\n</think>\n\n"  # Qwen3's empty think block


# what follows the last question when training on the completion: its reply, what the template writes around it
COMPLETION = {
    "qwen3": "<think>\n\n</think>\n\nThe Spree runs through Berlin.<|im_end|>\n",
    "llama3": "The Spree runs through Berlin.<|eot_id|>",
    "mistral": " The Spree runs through Berlin.</s>",
}


def test_completion_mask_is_the_last_turn(style):
    name, folder, theirs, ours = style
    record = chat_format(folder, ours, "completion").record({"messages": MESSAGES})
    ids, mask = ours.encode_chat(record.text, record.spans)
    first = int(np.argmax(mask))
    assert mask[:first].sum() == 0 and mask[first:].all()  # one stretch, to the end
    assert trained_runs(ours, ids, mask) == [COMPLETION[name]]
    # the same with the conversation as a prompt and a completion
    split = {"prompt": MESSAGES[:-1], "completion": MESSAGES[-1:]}
    other = chat_format(folder, ours, "completion").record(split)
    assert other == record


def test_record_shapes_a_review_found_refused_crashed_or_cut_short(style):
    name, folder, theirs, ours = style
    fmt, last = chat_format(folder, ours), chat_format(folder, ours, "completion")
    # a completion of no assistant turn: IndexError under 'completion' (prepare.py's traceback), a false reason under
    # 'assistant' ("every assistant message has weight 0")
    record = {"prompt": MESSAGES[1:3], "completion": [{"role": "user", "content": "Thanks."}]}
    for each in (fmt, last):
        with pytest.raises(UserError, match="^no assistant message to learn from in its completion$"):
            each.record(record)
    # a conversation the assistant opens: a template reading messages[0] refused the empty one before it
    if name != "mistral":  # (whose template refuses roles that do not alternate, as transformers')
        opened = [{"role": "assistant", "content": "Hello! Ask me of capitals."}, *MESSAGES[1:3]]
        chat_record = fmt.record({"messages": opened})
        assert chat_record.text == theirs.apply_chat_template(opened, tokenize=False)
        ids, mask = ours.encode_chat(chat_record.text, chat_record.spans)
        runs = trained_runs(ours, ids, mask)
        assert len(runs) == 2 and "Hello! Ask me" in runs[0] and "Paris is the capital" in runs[1], runs
    # Alpaca's system and history (LLaMA-Factory's): the context is the messages', not dropped
    alpaca = {"instruction": "And of Italy?", "output": "Rome, on the Tiber.", "system": MESSAGES[0]["content"],
              "history": [[MESSAGES[1]["content"], MESSAGES[2]["content"]]]}
    assert fmt.record(alpaca) == fmt.record({"messages": MESSAGES[:5]})
    # a system prompt beside OpenAI messages: the first message, as ShareGPT's; beside a system message: refused
    assert fmt.record({"messages": MESSAGES[1:5], "system": MESSAGES[0]["content"]}) == \
        fmt.record({"messages": MESSAGES[:5]})
    with pytest.raises(UserError, match="a 'system' prompt and a system message: keep one"):
        fmt.record({"messages": MESSAGES[:5], "system": "Be brief."})
    with pytest.raises(UserError, match="'history' is not a list of \\[instruction, output\\] pairs of strings"):
        fmt.record({**alpaca, "history": [["one"]]})


def test_a_prompts_own_replies_are_context_under_the_assistant_mask(style, tmp_path):
    # a prompt/completion record whose prompt holds earlier exchanges (few-shot): only the completion's reply is
    # trained, as TRL's completion-only loss, however the template marks replies ({% generation %} blocks too)
    name, folder, theirs, ours = style
    split = {"prompt": MESSAGES[:-1], "completion": MESSAGES[-1:]}
    formats = [chat_format(folder, ours)]
    if name == "qwen3":  # (its markers)
        formats.append(chat.ChatFormat(GENERATION, "test", ours.special_tokens(), ours.decode([ours.eot_id])))
    for fmt in formats:
        record = fmt.record(split)
        ids, mask = ours.encode_chat(record.text, record.spans)
        runs = [run.lstrip(" ") for run in trained_runs(ours, ids, mask)]
        assert len(runs) == 1 and runs[0].endswith("The Spree runs through Berlin." + fmt.end_of_turn), runs
        assert record.text == fmt.record({"messages": MESSAGES}).text  # the same text, every reply trained there
        # a weight of 0 on a reply of the prompt changes nothing: it is context either way
        weighted = {**split, "prompt": [*MESSAGES[:2], {**MESSAGES[2], "weight": 0}, *MESSAGES[3:-1]]}
        assert fmt.record(weighted) == record


def test_a_record_with_tools_where_transformers_takes_the_tool_use_template_is_skipped_and_said(tmp_path):
    # a tokenizer_config.json of named templates: transformers writes a record with tools with 'tool_use', not
    # 'default'; rendered with the default one, the tools would be dropped from what the model sees
    name = "qwen3"
    folder = make_folder(tmp_path / name, name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    config["chat_template"] = [{"name": "default", "template": plain}, {"name": "tool_use", "template": QWEN3}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    fmt = chat_format(folder, make_tokenizer(str(folder), None))
    tool = {"type": "function", "function": {"name": "lookup", "description": "Looks a word up.", "parameters": {}}}
    with pytest.raises(ValueError, match="it has tools, which transformers writes with .*'tool_use' template"):
        fmt.record({"messages": MESSAGES[1:3], "tools": [tool]})
    assert fmt.record({"messages": MESSAGES[1:3]}).text.startswith("<|im_start|>user\nWhat is")  # the default


def test_completion_mask_leaves_out_the_turns_after_the_last_reply(style):
    # a conversation that goes on past its last reply (a user's question no one answers): the completion is that
    # reply, closed by its end-of-turn; the question after it is no target
    name, folder, theirs, ours = style
    record = chat_format(folder, ours, "completion").record({"messages": MESSAGES[:6]})
    ids, mask = ours.encode_chat(record.text, record.spans)
    assert "Which river" in record.text and "Which river" not in ours.decode(ids[mask == 1].tolist())
    assert [run.lstrip(" ") for run in trained_runs(ours, ids, mask)] == [
        "Rome, on the Tiber." + STYLES[name]["end_of_turn"]]


def test_all_mask_is_everything(style):
    name, folder, theirs, ours = style
    record = chat_format(folder, ours, "all").record({"messages": MESSAGES})
    ids, mask = ours.encode_chat(record.text, record.spans)
    assert mask.all() and ours.decode(ids.tolist()) == record.text


def test_mistral_refuses_roles_that_do_not_alternate(tmp_path):
    folder = make_folder(tmp_path / "mistral", "mistral")
    ours = make_tokenizer(str(folder), None)
    fmt = chat_format(folder, ours)
    bad = [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hello?"},
           {"role": "assistant", "content": "Yes."}]
    with pytest.raises(ValueError, match="alternate"):
        fmt.record({"messages": bad})

# TRL's assistant-only templates: ChatML, the assistant's reply and end-of-turn inside {% generation %}
GENERATION = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}{{- message.content + '<|im_end|>' }}{%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}"""


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_generation_template_masks_are_transformers(style, tmp_path):
    # {% generation %} renders its text as it is (no tags in it) and says what is trained: the masks of
    # --train_on=assistant equal transformers' return_assistant_tokens_mask, in chat.py and through prepare.py
    name, folder, theirs, ours = style
    fmt = chat.ChatFormat(GENERATION, "test", ours.special_tokens(), ours.decode([ours.eot_id]))
    # (a reply that begins with a character the vocabulary splits into bytes, an emoji: each of its tokens trained)
    emoji = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\U0001F600 Paris"}]
    conversations = [MESSAGES, MESSAGES[1:], MESSAGES[1:3], emoji]
    for messages in conversations:
        out = theirs.apply_chat_template(messages, chat_template=GENERATION, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        record = fmt.record({"messages": messages})
        assert record.text == theirs.apply_chat_template(messages, chat_template=GENERATION, tokenize=False)
        assert fmt.render(messages, add_generation_prompt=True) == theirs.apply_chat_template(
            messages, chat_template=GENERATION, tokenize=False, add_generation_prompt=True)
        ids, mask = ours.encode_chat(record.text, record.spans)
        assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])
        assert sum(mask) > 0
    (tmp_path / "t.jinja").write_text(GENERATION)
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         f"--chat_template={tmp_path / 't.jinja'}", "--val_fraction=0"])
    want_ids, want_mask = [], []
    for messages in conversations:  # each example, then an end-of-text the mask marks as its end (END, untrained)
        out = theirs.apply_chat_template(messages, chat_template=GENERATION, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        want_ids += list(out["input_ids"]) + [meta["eot_id"]]
        want_mask += list(out["assistant_masks"]) + [END]
    assert np.fromfile(tmp_path / "data" / "train.bin", dtype=meta["dtype"]).tolist() == want_ids
    assert np.fromfile(tmp_path / "data" / "train.mask.bin", dtype=np.uint8).tolist() == want_mask


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_a_chat_runs_replies_end_where_its_exports_do(style, tmp_path):
    # sample.py --chat ends a run's reply at the ids its export's generation_config.json names (the end-of-turn and
    # the data's end-of-text), where transformers' generate on the export stops, and the export's reply there too
    from helpers import TINY, run, script
    from lib.trained import chat_stops, load_run
    name, folder, theirs, ours = style
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(30)))
    prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}"])
    run(*TINY, f"--data_dir={tmp_path / 'data'}", f"--out_dir={tmp_path / 'run'}", "--max_iters=1")
    done = script("export.py", f"--out_dir={tmp_path / 'run'}", f"--to={tmp_path / 'hf'}")
    assert done.returncode == 0, done.stderr
    exported = set(json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"])
    _, tokenizer, checkpoint = load_run(str(tmp_path / "run" / "ckpt.pt"))
    end_of_turn = tokenizer.special_tokens()["<|im_end|>"]
    assert exported == {end_of_turn, tokenizer.eot_id} and end_of_turn != tokenizer.eot_id
    assert set(chat_stops(str(tmp_path / "data"), tokenizer, end_of_turn, checkpoint)) == exported
    assert set(chat_stops(str(tmp_path / "hf"), tokenizer, end_of_turn)) == exported


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_a_folder_without_a_template_gets_the_built_in_one_with_a_warning(style, tmp_path, capsys):
    name, folder, theirs, ours = style
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n")
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={tmp_path / 'bare'}", "--val_fraction=0",
                         f"--out_dir={tmp_path / 'data'}"])
    assert meta["chat"]["template_from"] == "built-in"
    assert f"warning: {tmp_path / 'bare'} has no chat template" in capsys.readouterr().out
    prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", "--val_fraction=0",
                  f"--out_dir={tmp_path / 'own'}"])
    assert "warning" not in capsys.readouterr().out  # the folder's own template: nothing to say

# -----------------------------------------------------------------------------
# 3. prepare.py: a .jsonl of every record kind -> masked dataset


@pytest.mark.parametrize("name", sorted(STYLES))
def test_prepare_masked_dataset(tmp_path, name):
    folder = make_folder(tmp_path / name, name)
    records = [
        {"messages": MESSAGES},
        {"messages": MESSAGES[1:3]},
        {"prompt": "Capital of Spain?", "completion": " Madrid, on the Manzanares."},
        {"prompt": [{"role": "user", "content": "Capital of Portugal?"}],
         "completion": [{"role": "assistant", "content": "Lisbon, on the Tagus."}]},
        {"instruction": "Name a river in Berlin.", "input": "", "output": "The Spree flows there."},
        {"instruction": "Translate to French.", "input": "river", "output": "fleuve or riviere"},
        {"messages": [{"role": "user", "content": "Nobody answers this."}]},
    ]
    lines = [json.dumps(r) for r in records]
    lines.insert(3, '{"messages": [{"role": "user", "content": "broken"')  # line 4: malformed
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "data"
    meta = prepare.main([str(path), f"--tokenizer={folder}", f"--out_dir={out}", "--num_workers=1"])

    end = STYLES[name]["end_of_turn"]
    assert meta["masks"] is True and meta == json.loads((out / "meta.json").read_text())
    assert meta["chat"]["end_of_turn"] == end and meta["chat"]["train_on"] == "assistant"
    assert meta["chat"]["template"] == STYLES[name]["template"]
    bad = meta["bad_records"]
    assert bad["count"] == 2, bad
    assert any(":4: malformed JSON" in e for e in bad["examples"]), bad
    assert any(":8: no assistant message" in e for e in bad["examples"]), bad

    ours = load_tokenizer(out)
    runs, documents, bos_counts, examples = [], 0, [], []
    for split in ("train", "val"):
        ids = np.fromfile(out / f"{split}.bin", dtype=meta["dtype"])
        mask = np.fromfile(out / f"{split}.mask.bin", dtype=np.uint8)
        assert ids.size == mask.size == meta[split]["tokens"] > 0  # one byte per token
        assert int((mask == 1).sum()) == meta[split]["targets"] > 0
        # Mistral's end-of-text is </s>, which also closes a reply: there, trained; after an example, marked END
        eots = np.flatnonzero(ids == meta["eot_id"])
        separators = eots[mask[eots] == END]
        assert len(separators) == meta[split]["documents"] and separators[-1] == ids.size - 1
        assert mask[-1] == END and set(np.unique(mask)) <= {0, 1, END}
        starts = np.concatenate([[0], separators[:-1] + 1])
        for start, stop in zip(starts, separators):  # each example ends with its marked end-of-text
            assert ids[stop] == meta["eot_id"] and (mask[start:stop] == 1).any() and END not in mask[start:stop]
        if name == "llama3":  # the template's BOS, once: encode_chat adds none of its own
            bos = ours.special_tokens()["<|begin_of_text|>"]
            bos_counts += [int((ids[start:stop] == bos).sum()) for start, stop in zip(starts, separators)]
            for start, stop in zip(starts, separators):
                assert ids[start] == bos
            examples += [ids[start:stop].tolist() for start, stop in zip(starts, separators)]
        documents += len(separators)
        runs += [run.lstrip(" ") for run in trained_runs(ours, ids, mask)]
    assert documents == 6
    if name == "qwen3":  # the last turn of each of the 5 templated conversations begins with its think block
        assert sum(run.startswith(THINK) for run in runs) == 5
        runs = [run.removeprefix(THINK) for run in runs]
    if name == "llama3":  # the prompt and completion strings, text without the template, begin with the BOS
        assert bos_counts == [1] * 6  # the tokenizer puts before a text (as TRL's tokenization of them does)
        auto = transformers.AutoTokenizer.from_pretrained(str(folder))
        plain = auto("Capital of Spain? Madrid, on the Manzanares.")["input_ids"] + [auto.convert_tokens_to_ids(end)]
        assert plain in examples
    expected = [*REPLIES, REPLIES[0], "Madrid, on the Manzanares.", "Lisbon, on the Tagus.",
                "The Spree flows there.", "fleuve or riviere"]
    assert sorted(runs) == sorted(reply + end for reply in expected)


def test_plain_prompt_completion_strings_keep_no_template_for_a_chat(tmp_path):
    # strings are trained as plain text: the dataset names no chat template, and sample.py --chat refuses to wrap
    # a prompt in one the model never saw (records written with the template keep it: the test above)
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    path = tmp_path / "pc.jsonl"
    empty = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]}  # refused
    path.write_text("".join(json.dumps({"prompt": f"Capital number {i}?", "completion": f" City {i}."}) + "\n"
                            for i in range(8)) + json.dumps(empty) + "\n", encoding="utf-8")
    meta = prepare.main([str(path), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}"])
    assert meta["masks"] is True and "chat" not in meta and meta["bad_records"]["count"] == 1
    assert chat.find_template(tmp_path / "data")[1] == "built-in"


def test_a_readme_read_before_a_folders_conversations_is_refused_not_trained_on(tmp_path):
    # the first document decides the dataset's kind: a README.md sorted first made 60 conversations "a conversation
    # among texts", listed, and the README alone the dataset (exit 0); the other way round, a text among conversations
    # is left out as it was
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "README.md").write_text("These are our support conversations.\n")
    (tmp_path / "src" / "chats.jsonl").write_text("".join(json.dumps({"messages": MESSAGES}) + "\n" for _ in range(6)))
    with pytest.raises(UserError, match=rf"^{tmp_path / 'src' / 'README.md'}, read first, made this a dataset of "
                                        r"texts, and 6 conversations were left out, more than the 1 texts kept: "
                                        r"prepare the two kinds apart \(leave .*README.md out\)$"):
        prepare.main([str(tmp_path / "src"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}"])
    assert not (tmp_path / "data").exists()
    (tmp_path / "src" / "README.md").rename(tmp_path / "src" / "z_notes.md")  # read after them: left out, listed
    meta = prepare.main([str(tmp_path / "src"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         "--val_fraction=0.2"])
    assert meta["masks"] and [s["reason"] for s in meta["skipped_files"]] == [
        "a text among conversations (prepare the two kinds apart)"]
    # texts that outnumber them after a conversation read first (notes beside a small chat file): left out as before
    for i in range(8):
        (tmp_path / "src" / f"z_note{i}.txt").write_text(f"note {i}\n")
    meta = prepare.main([str(tmp_path / "src"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         "--val_fraction=0.2", "--overwrite"])
    assert meta["masks"] and meta["files_skipped"] == 9
    # the kind decided by the training inputs' text, the conversations in --val_input: no file of its to blame
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "book.txt").write_text("A book of text.\n" * 20)
    with pytest.raises(UserError, match=r"^the training inputs, read first, made this a dataset of texts, and 6 "
                                        r"conversations were left out, .* \(--val_input holds conversations\)$"):
        prepare.main([str(tmp_path / "book"), f"--val_input={tmp_path / 'src' / 'chats.jsonl'}",
                      f"--tokenizer={folder}", f"--out_dir={tmp_path / 'mixed'}"])


def test_a_templates_own_end_of_text_inside_a_conversation_ends_no_example(tmp_path):
    # Zephyr's template closes every turn, a user's too, with the eos, Mistral's end-of-text </s>: only the one
    # prepare.py puts after a conversation ends an example, so that each reply is trained with its question in view
    from lib.data import Split
    folder = make_folder(tmp_path / "mistral", "mistral")
    (tmp_path / "zephyr.jinja").write_text("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                                           "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>"
                                           "\n{% endif %}")
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n" +
                                          json.dumps({"messages": MESSAGES[1:5]}) + "\n")
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         f"--chat_template={tmp_path / 'zephyr.jinja'}", "--val_fraction=0"])
    train = Split(str(tmp_path / "data"), "train", meta, 512, 0, True, 512)
    assert meta["train"]["documents"] == len(train.starts) == 2
    ours, ids = load_tokenizer(tmp_path / "data"), np.fromfile(tmp_path / "data" / "train.bin", dtype=meta["dtype"])
    first = ours.decode(ids[train.starts[0]:train.starts[0] + train.lengths[0]].tolist())
    assert first.index("What is the capital of France?") < first.index("Paris is") < first.index("Berlin.")
    # a folder prepared before the mark (format 1, 0 there) reads as it did: an example ends at each untrained </s>
    mask = np.fromfile(tmp_path / "data" / "train.mask.bin", dtype=np.uint8)
    np.where(mask == END, 0, mask).astype(np.uint8).tofile(tmp_path / "data" / "train.mask.bin")
    old = Split(str(tmp_path / "data"), "train", {**meta, "format_version": 1}, 512, 0, True, 512)
    assert len(old.starts) == 8 and old.targets == train.targets


def test_a_bare_tokenizer_json_gives_the_template_the_bos_it_puts_before_a_text(tmp_path):
    # no tokenizer_config.json beside it to name the BOS: the one the tokenizer.json puts before a text, which
    # Llama 3's template writes first, as prepare.py puts it before a plain prompt/completion record
    folder = make_folder(tmp_path / "llama3", "llama3")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "t.jinja").write_text(STYLES["llama3"]["template"])
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": MESSAGES}) + "\n" +
                                          json.dumps({"prompt": "Capital of Spain?", "completion": " Madrid."}) + "\n")
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={tmp_path / 'bare' / 'tokenizer.json'}",
                         f"--out_dir={tmp_path / 'data'}", f"--chat_template={tmp_path / 't.jinja'}",
                         "--val_fraction=0"])
    ids = np.fromfile(tmp_path / "data" / "train.bin", dtype=meta["dtype"])
    starts = [0, *(np.flatnonzero(np.fromfile(tmp_path / "data" / "train.mask.bin", np.uint8) == END)[:-1] + 1)]
    bos = load_tokenizer(tmp_path / "data").special_tokens()["<|begin_of_text|>"]
    assert [int(ids[s]) for s in starts] == [bos, bos] and int((ids == bos).sum()) == 2

# -----------------------------------------------------------------------------
# 4. a template is code from the internet: the sandbox keeps it from Python and files

PROBE = "{% for m in messages %}{{ m['content'] }}</s>{% endfor %}"  # closes a reply with a special token

ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ cycler.__init__.__globals__.os.listdir('/') }}",
    "{{ open('/etc/passwd').read() }}",
    "{{ messages.append(1) }}",  # the immutable sandbox: a template changes no message
]
LOADS = ["{% include '/etc/passwd' %}", "{% import '/etc/passwd' as secrets %}", "{% extends '/etc/passwd' %}"]


@pytest.mark.parametrize("escape", ESCAPES)
def test_template_is_sandboxed(escape):
    from jinja2.exceptions import SecurityError
    # ChatFormat renders a probe conversation when it is made: that meets the escape
    with pytest.raises((SecurityError, ValueError), match="unsafe|undefined"):
        chat.ChatFormat(PROBE + escape, "test", ["</s>"], "</s>")


@pytest.mark.parametrize("escape", ["{{ ''.__class__ }}", "{{ '{0.__class__}'.format('') }}",
                                    "{{ messages|attr('__class__') }}", "{{ ''.format.__self__ }}"])
def test_template_prints_nothing_of_python(escape):
    # an unsafe attribute only printed is jinja2's undefined, which prints as nothing
    fmt = chat.ChatFormat(PROBE + escape, "test", ["</s>"], "</s>")
    assert fmt.render([{"role": "user", "content": "Hi"}]) == "Hi</s>"


@pytest.mark.parametrize("load", LOADS)
def test_template_reads_no_file(load):
    # the sandbox has no loader: nothing is read (transformers' raises the same TypeError)
    with pytest.raises(Exception) as refused:
        chat.ChatFormat(PROBE + load, "test", ["</s>"], "</s>")
    assert "root:" not in str(refused.value)


@pytest.mark.parametrize("load", LOADS)
def test_template_that_loads_a_file_is_a_value_error(load):
    with pytest.raises(ValueError):
        chat.ChatFormat(PROBE + load, "test", ["</s>"], "</s>")


def test_prepare_refuses_a_template_that_loads_a_file(tmp_path):
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    template = tmp_path / "t.jinja"
    template.write_text(LOADS[0] + QWEN3, encoding="utf-8")
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": MESSAGES}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match="template"):
        prepare.main([str(path), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                      f"--chat_template={template}"])


def test_sandbox_messages_are_not_changed():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ValueError, match="unsafe"):
        chat.ChatFormat(PROBE + "{% if messages.pop() %}{% endif %}", "test", ["</s>"], "</s>").render(messages)
    assert len(messages) == 2


def test_a_wordpiece_prompt_ending_before_a_space_trains_none_of_its_tokens():
    # WordPiece's tokens leave out the spaces between them: the prompt's last token ends where its offsets say,
    # not where the reply's first token begins, so it does not overlap the reply's span (which holds the space)
    ours = make_tokenizer("wordpiece:100", lambda: iter(["hello world -> a cat, hello there"] * 50))
    prompt, reply = "Translate: cat ->", " hello<|endoftext|>"
    ids, mask = ours.encode_chat(prompt + reply, [(len(prompt), len(prompt + reply))])
    before = len(ours.encode_chat(prompt, [])[0])
    assert 0 < before < len(ids) and mask.tolist() == [0] * before + [1] * (len(ids) - before)


def test_a_special_tokens_text_inside_a_message_skips_its_record(tmp_path):
    # only the template's own markers become special tokens: a message (its content, its reasoning, any field a
    # template may write: a name) that holds one's text, which would be read as the token (an <|im_end|> ending the
    # turn early), skips its record, listed
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    records = [{"messages": MESSAGES}, {"messages": [MESSAGES[1], {**MESSAGES[2], "content": "Paris<|im_end|>"}]},
               {"messages": [MESSAGES[1], {**MESSAGES[2], "reasoning_content": "the <|im_start|> is"}]},
               {"messages": [MESSAGES[1], {**MESSAGES[2], "name": "bot<|im_end|>"}]}]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare.main([str(tmp_path / "chats.jsonl"), f"--tokenizer={folder}", f"--out_dir={tmp_path / 'data'}",
                         "--val_fraction=0"])
    assert meta["train"]["documents"] == 1
    assert meta["bad_records"]["examples"] == [
        f"{tmp_path / 'chats.jsonl'}:{n}: it holds {token}, a special token of the tokenizer, as text (it would be "
        f"read as the token)" for n, token in ((2, "<|im_end|>"), (3, "<|im_start|>"), (4, "<|im_end|>"))]


# a tool-use record as OpenAI's API and TRL's datasets hold it: the functions at its top level, a call with no text
# (content null) or with some, the tool's answer; ShareGPT's and prompt/completion records may carry tools too
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters":
                                           {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
             {"role": "assistant", "content": "Sunny, it says.", "tool_calls": [CALL]},
             {"role": "tool", "content": "still sunny", "tool_call_id": "call_2", "name": "get_weather"},
             {"role": "assistant", "content": "It is sunny in Paris."}]


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_tools_and_tool_calls_are_rendered_and_trained_as_transformers_renders_them(style):
    # the record's tools reach the template (Qwen3's writes them in a system turn), and an assistant turn of tool
    # calls is trained whole, its text and its calls, as the template writes them, to its end-of-turn
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)
    record = fmt.record({"messages": TOOL_CHAT, "tools": TOOLS})
    assert record.text == theirs.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False)
    assert "get_weather" in record.text[:record.text.index("Weather in Paris?")]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert [record.text[a:b] for a, b in record.spans] == [call, "Sunny, it says.\n" + call,
                                                           THINK + "It is sunny in Paris.<|im_end|>"]
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}], "tools": TOOLS}
    assert fmt.record(sharegpt).text == theirs.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], tools=TOOLS, tokenize=False)
    assert fmt.record({"prompt": TOOL_CHAT[:1], "completion": TOOL_CHAT[1:], "tools": TOOLS}) == record
    # a template that writes no tool calls (Llama 3's here), or tools as a text of JSON: refused, saying why
    llama = chat.ChatFormat(LLAMA3, "llama3", STYLES["llama3"]["special"], "<|eot_id|>", bos_token="<|begin_of_text|>")
    with pytest.raises(UserError, match="does not write assistant message 2's tool_calls"):
        llama.record({"messages": TOOL_CHAT})
    with pytest.raises(UserError, match="'tools' is not a list of JSON objects"):
        fmt.record({"messages": TOOL_CHAT, "tools": json.dumps(TOOLS)})


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_a_sharegpt_turn_of_weight_0_is_not_trained(style):
    # ShareGPT's weight (axolotl's): 0 keeps a reply in view and out of the targets; the text is transformers' still
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there", "weight": 0},
             {"from": "human", "value": "Again?"}, {"from": "gpt", "value": "Yes, again.", "weight": 1}]
    record = fmt.record({"conversations": turns})
    messages = [{"role": m, "content": t["value"]} for m, t in zip(["user", "assistant"] * 2, turns)]
    assert record.text == theirs.apply_chat_template(messages, tokenize=False)
    assert [record.text[a:b] for a, b in record.spans] == [THINK + "Yes, again.<|im_end|>"]
    with pytest.raises(UserError, match="every assistant message has weight 0"):
        fmt.record({"conversations": turns[:2]})
    with pytest.raises(UserError, match="weight is 0.5"):
        fmt.record({"conversations": [turns[0], {**turns[1], "weight": 0.5}]})


def test_a_sharegpt_records_system_prompt_is_its_first_message(style):
    # LLaMA-Factory's ShareGPT files hold the system prompt beside the turns: rendered first, as transformers renders
    # the same messages, and untrained; beside a system turn of its own, or not a text, the record is refused
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)
    turns = [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]
    record = fmt.record({"conversations": turns, "system": "Be terse."})
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}]
    assert record.text == theirs.apply_chat_template(messages, tokenize=False)
    assert "Be terse." in record.text and all("Be terse." not in record.text[a:b] for a, b in record.spans)
    assert fmt.record({"conversations": turns, "system": ""}).text == fmt.record({"conversations": turns}).text
    with pytest.raises(UserError, match="a 'system' prompt and a system message"):
        fmt.record({"conversations": [{"from": "system", "value": "Be kind."}, *turns], "system": "Be terse."})
    with pytest.raises(UserError, match="'system' is not a text"):
        fmt.record({"conversations": turns, "system": ["Be terse."]})


def test_an_alpaca_records_input_follows_its_instruction_and_may_be_left_out(style):
    # Alpaca's input joins the instruction in the user's message, after a blank line; a record without the key (as
    # many are) is a conversation still, of the instruction alone
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours)

    def conversation(user, assistant):
        return fmt.record({"messages": [{"role": "user", "content": user},
                                        {"role": "assistant", "content": assistant}]})
    record = fmt.record({"instruction": "Translate to French.", "input": "river", "output": "rivière"})
    assert record.text == conversation("Translate to French.\n\nriver", "rivière").text
    assert chat.is_conversation({"instruction": "Say hi.", "output": "Hi."})
    assert fmt.record({"instruction": "Say hi.", "output": "Hi."}).text == conversation("Say hi.", "Hi.").text
    # an empty instruction (the whole prompt in the input, as some datasets give it) opens with no blank line
    assert fmt.record({"instruction": "", "input": "river", "output": "rivière"}).text == \
        conversation("river", "rivière").text


@pytest.mark.parametrize("style", ["qwen3"], indirect=True)
def test_content_as_a_list_of_parts_is_refused_naming_the_fix(style):
    # OpenAI's multimodal layout, [{"type": "text", "text": ...}]: a text model's template writes no parts (Qwen3's
    # writes nothing of them), so the record is refused in one line that says how to give it
    _, folder, _, ours = style
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(UserError, match=r"^messages 1's content is a list of parts \(multimodal\): give its text as "
                                        r"one string$"):
        chat_format(folder, ours).record({"messages": parts})


def test_a_special_token_whose_spelling_json_escapes_is_found_in_a_message():
    # the check read each message as JSON text, where a newline or a quote is escaped: such a token went unseen
    fmt = chat.ChatFormat(PROBE, "test", ["</s>", '<said\n"this">'], "</s>")
    said = 'y <said\n"this">'
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": said}}]}
    for record in ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": said}]},
                   {"instruction": "x", "output": said}, {"messages": [{"role": "user", "content": "x"}, call]}):
        with pytest.raises(UserError, match="a special token of the tokenizer, as text"):
            fmt.record(record)


def test_a_generation_block_written_cut_is_refused_in_one_line():
    # a template that sets a block's text in a variable and writes a part of it: its marks unpaired, a UserError
    # naming the template, not an IndexError's traceback
    cut = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% set x %}{% generation %}"
           "{{ m.content }}{% endgeneration %}{% endset %}{{ x[1:] }}{% generation %}<|im_end|>{% endgeneration %}"
           "{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}")
    fmt = chat.ChatFormat(cut, "cut.jinja", STYLES["qwen3"]["special"], "<|im_end|>")
    with pytest.raises(UserError, match=r"^the chat template \(cut.jinja\) writes a \{% generation %\} block's"):
        fmt.record({"messages": MESSAGES[1:3]})


@pytest.mark.parametrize("train_on", ["completion", "all"])
def test_completion_and_all_skip_the_records_the_assistant_mask_skips(style, train_on):
    # an empty reply, or tool_calls the template does not write (Llama 3's): skipped under any train_on, as the docs
    # say, not trained as a turn of nothing
    name, folder, theirs, ours = style
    fmt = chat_format(folder, ours, train_on)
    for at in (2, 6):
        with pytest.raises(UserError, match=f"^assistant message {at + 1} is empty"):
            fmt.record({"messages": [*MESSAGES[:at], {"role": "assistant", "content": ""}, *MESSAGES[at + 1:]]})
    llama = chat.ChatFormat(LLAMA3, "llama3", STYLES["llama3"]["special"], "<|eot_id|>", train_on,
                            bos_token="<|begin_of_text|>")
    with pytest.raises(UserError, match="does not write assistant message 2's tool_calls"):
        llama.record({"messages": TOOL_CHAT})


def test_a_folders_saved_tool_use_template_skips_a_record_with_tools(tmp_path):
    # transformers' save_pretrained writes named templates as chat_template.jinja (the default) and
    # additional_chat_templates/tool_use.jinja, which it takes for a record with tools: skipped, as from the config
    folder = make_folder(tmp_path / "qwen3", "qwen3")
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    theirs.chat_template = {"default": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                       "{% endfor %}", "tool_use": QWEN3}
    theirs.save_pretrained(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "additional_chat_templates" / "tool_use.jinja").is_file()
    fmt = chat_format(tmp_path / "saved", make_tokenizer(str(tmp_path / "saved"), None))
    with pytest.raises(UserError, match="it has tools, which transformers writes with .*'tool_use' template"):
        fmt.record({"messages": MESSAGES[1:3], "tools": TOOLS})
