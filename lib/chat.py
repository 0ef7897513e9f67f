"""
Conversations and instructions -> a chat template's text of them and the characters a model learns to write (a Chat),
for prepare.py's records and the conversations sample.py continues, with the same template.

    from lib.chat import ChatFormat
    fmt = ChatFormat.for_tokenizer("models/Qwen3-0.6B", {"<|im_end|>": 151645, ...}, train_on="assistant")
    chat = fmt.record({"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]})
    chat.text, chat.spans   # '<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n', [(..)]

Records: {"messages": [{"role", "content"}, ...]}, ShareGPT's {"conversations": [{"from", "value"}, ...]},
{"prompt", "completion"} (strings, or lists of messages) and Alpaca's {"instruction", "input", "output"}. A template
is code from the internet: it runs in jinja2's sandbox, as in transformers, away from files and Python's internals.
"""

import json
import re
import time
from collections import namedtuple
from datetime import datetime
from pathlib import Path

from lib.files import UserError, read_json

Chat = namedtuple("Chat", "text spans")  # spans: [(start, end)] of the characters that are training targets
ROLES = ("system", "user", "assistant", "tool")
# A rendering is refused past so many loop steps and calls, or characters written: far past any conversation's needs.
MAX_STEPS = 1_000_000
MAX_OUTPUT = 1 << 24
MAX_WIDTH = 1 << 12  # a filter's number (center's width, indent's, truncate's length) and an int's bits, at most
MAX_SECONDS = 10  # a rendering's time, at most: a legit template renders a conversation in milliseconds
TRAIN_ON = ("assistant", "completion", "all")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool"}
STAND_IN = "\ue000\ue001\ue000"  # stands for a reply while finding where a template writes it (private use)
MARKS = ("\ue002", "\ue003")  # where a {% generation %} block's text begins and ends, until render() drops them
# Without a tokenizer's template: a header per turn, each assistant turn closed by end-of-text (sample.py stops there)
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def is_conversation(obj):
    """Whether a JSON record holds a conversation or an instruction rather than a text."""
    keys = obj.keys() if isinstance(obj, dict) else set()
    return "messages" in keys or "conversations" in keys or {"prompt", "completion"} <= keys or \
        {"instruction", "output"} <= keys


def sharegpt_messages(turns, system=None):
    """ShareGPT's turns ([{"from": "human", "value": ...}, ...]) -> messages, or ValueError saying why not; system:
    the record's own system prompt (LLaMA-Factory's "system"), the first message."""
    if not isinstance(turns, list) or not turns:
        raise UserError("'conversations' is not a list of turns")
    messages = []
    for i, turn in enumerate(turns, 1):
        if isinstance(turn, dict) and {"role", "content"} <= turn.keys():  # already messages
            messages.append(turn)
            continue
        role = turn.get("from") if isinstance(turn, dict) else None
        if not isinstance(role, str) or role not in SHAREGPT_ROLES or not isinstance(turn.get("value"), str):
            raise UserError(f"conversations {i} is not a turn with a 'from' ({'/'.join(SHAREGPT_ROLES)}) and a "
                             f"text 'value'")
        weight = {"weight": turn["weight"]} if "weight" in turn else {}  # (0: a turn not to train, as in axolotl)
        messages.append({"role": SHAREGPT_ROLES[role], "content": turn["value"], **weight})
    return with_system(messages, system)


def alpaca_messages(record):
    """An Alpaca record (instruction, input, output; LLaMA-Factory's system and history of [instruction, output]
    pairs before it) -> messages, or ValueError saying why not."""
    instruction, given, output = record["instruction"], record.get("input") or "", record.get("output")
    history = record.get("history") or []
    if not all(isinstance(s, str) for s in (instruction, given, output)):
        raise UserError("instruction, input and output must be strings")
    pairs = isinstance(history, list) and all(isinstance(p, list) and len(p) == 2 for p in history)
    if not pairs or not all(isinstance(s, str) for p in history for s in p):
        raise UserError("'history' is not a list of [instruction, output] pairs of strings")
    # the input follows the instruction after a blank line; an empty instruction leaves the input alone
    turns = [*history, ["\n\n".join(text for text in (instruction, given) if text), output]]
    return with_system([{"role": role, "content": text} for pair in turns
                        for role, text in zip(("user", "assistant"), pair)], record.get("system"))


def with_system(messages, system):
    # messages after a record's own system prompt (ShareGPT's, Alpaca's, beside OpenAI messages), or ValueError
    if system is not None and not isinstance(system, str):
        raise UserError("'system' is not a text: give the system prompt as a string")
    if system and any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        raise UserError("it has a 'system' prompt and a system message: keep one")
    return ([{"role": "system", "content": system}] if system else []) + messages


def with_reasoning(message):
    # a message's reasoning (any name) as templates read it: reasoning_content (Qwen3's) and thinking (gpt-oss's)
    reasoning = next((message[key] for key in ("reasoning_content", "thinking", "reasoning")
                      if isinstance(message, dict) and message.get(key) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def compile_template(source):
    """A template -> render(**context) -> str, sandboxed with transformers' globals, within MAX_STEPS and MAX_OUTPUT."""
    from jinja2 import nodes
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, generation_tags()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # (random text of any length: no template of a model's writes it)
    steps = budget(env)
    try:
        tree = env.parse(source)
        for loop in list(tree.find_all(nodes.For)):  # every loop's items are counted as they are taken
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None)
        for concat in list(tree.find_all(nodes.Concat)):  # and what ~ joins is measured, its parts before str()
            joined = nodes.Concat([nodes.Call(nodes.EnvironmentAttribute("finalize"), [part], [], None, None)
                                   for part in concat.nodes])
            concat.nodes = [nodes.Call(nodes.EnvironmentAttribute("bounded"), [joined], [], None, None)]
        template = env.from_string(tree)
    except TemplateError as e:
        raise UserError(f"the chat template does not compile ({e})") from None

    def render(keep_budget=False, **context):  # keep_budget: what is left of the last rendering's budget
        if not keep_budget:
            steps[:] = [0, time.monotonic() + MAX_SECONDS]
        out, size = [], 0
        for text in template.root_render_func(template.new_context(context)):  # what render() joins
            size += len(text)
            if size > MAX_OUTPUT:
                raise TemplateError(f"it writes more than {MAX_OUTPUT:,} characters")
            out.append(text)
        return "".join(out)
    return render


def budget(env):
    # Counts a rendering's steps in env, TemplateError past MAX_STEPS or MAX_SECONDS (an `in` over a long text is a
    # step): a loop step one, a call or filter ten; a str method's call must stay within str_call_within. A *, +
    # or % may not make a value past MAX_OUTPUT, a ** a power past 64, ints past MAX_WIDTH bits; env.bounded measures
    # what ~ joins and filters return. Intercepted operators aren't folded at compile time. -> steps (render resets it).
    from jinja2.exceptions import TemplateError
    steps, sandbox_call, sandbox_binop = [0, 0.0], env.call, env.call_binop  # (render sets the deadline)

    def step(cost=1):
        steps[0] += cost
        if steps[0] > MAX_STEPS:
            raise TemplateError(f"it takes more than {MAX_STEPS:,} steps")
        if time.monotonic() > steps[1]:
            raise TemplateError(f"it takes more than {MAX_SECONDS} s")

    def counted(items):
        for item in items:
            step()
            yield item

    def call(context, obj, *args, **kwargs):
        step(10)  # a call takes about ten loop steps' time, a macro's more
        method = getattr(obj, "__wrapped__", obj)  # (the sandbox wraps a str's format in a function of its own)
        text_method = isinstance(getattr(method, "__self__", None), str)
        if text_method and not str_call_within(method, [*args, *kwargs.values()]):
            raise TemplateError(f"its {method.__name__} makes a text past the budget of a chat template")
        return bounded(sandbox_call(context, obj, *args, **kwargs))

    def bounded(value):
        if isinstance(value, (str, list, tuple)) and len(value) > MAX_OUTPUT:
            raise TemplateError(f"it makes a value of more than {MAX_OUTPUT:,} characters or items")
        return value

    def finalize(value):  # a value written ({{ }}, ~), measured before str() writes it: lists of lists grow fast
        if not isinstance(value, str) and written(value) > MAX_OUTPUT:
            raise TemplateError(f"it writes a value of more than {MAX_OUTPUT:,} characters")
        return value

    def binop(context, operator, left, right):
        if operator == "+":  # measured after: a value at most twice the budget, cheaper than measuring first
            value = left + right
            if type(value) is str and len(value) > MAX_OUTPUT:
                raise TemplateError(f"it makes a text of more than {MAX_OUTPUT:,} characters")
            return bounded(value)  # a list or tuple too (one doubled in a loop)
        bits = [x.bit_length() for x in (left, right) if type(x) is int]
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64 or operator == "*" and \
                any(type(x) is int and abs(x) > 1 and MAX_OUTPUT // abs(x) < len(y)
                    for x, y in ((left, right), (right, left)) if isinstance(y, (str, list, tuple))) \
                or len(bits) == 2 and operator != "%" and (sum(bits) if operator == "*" else bits[0] * abs(right)) \
                > MAX_WIDTH \
                or operator == "%" and isinstance(left, str) and not formats_within(left, right):
            raise TemplateError(f"its {operator} makes a value past the budget of a chat template")
        return bounded(sandbox_binop(context, operator, left, right))

    env.filters = {name: checked_filter(name, run, step, bounded) for name, run in env.filters.items()}
    env.counted, env.bounded, env.call, env.call_binop, env.finalize = counted, bounded, call, binop, finalize
    env.intercepted_binops = frozenset({"*", "+", "**", "%"})
    return steps


def str_call_within(method, values):
    # whether a str method's call (method bound to its text, given values) makes a text within the budget: a width
    # (ljust's, center's, zfill's, expandtabs', a format field's, or a number a nested field takes) at most MAX_WIDTH,
    # and what expandtabs, replace, join, format and translate make at most MAX_OUTPUT, measured before they make it
    # (a format's field each all its values, a translated character the longest text); a number a format writes is no
    # width
    text, name, texts = method.__self__, method.__name__, [v for v in values if isinstance(v, str)]
    widths = name in ("ljust", "rjust", "center", "zfill", "expandtabs") or \
        name in ("format", "format_map") and re.search(r"\{[^{}]*\{", text)  # '{:>{w}}': its width from w
    numbers = [*values, *(v for mapping in values if isinstance(mapping, dict) for v in mapping.values())]
    if widths and any(type(v) is int and abs(v) > MAX_WIDTH for v in numbers):  # (format_map's in its mapping)
        return False
    if name in ("format", "format_map") and any(int(n) > MAX_WIDTH for field in re.findall(r"\{[^{}]*\}", text)
                                                for n in re.findall(r"\d+", field)):
        return False
    grows = {"expandtabs": lambda: text.count("\t") * MAX_WIDTH,
             **dict.fromkeys(("format", "format_map"), lambda: text.count("{") * written(values)),
             "translate": lambda: len(text) * max((len(v) for v in (values[0].values() if isinstance(values[0], dict)
                                                                     else values[0]) if isinstance(v, str)), default=1)
             if values and isinstance(values[0], (dict, list, tuple)) else 0,
             "replace": lambda: len(texts[1]) * text.count(texts[0]) if len(texts) >= 2 else 0,
             "join": lambda: len(text) * len(values[0]) + sum(len(str(x)) for x in values[0])
             if values and hasattr(values[0], "__len__") else 0}
    return len(text) + grows.get(name, lambda: 0)() <= MAX_OUTPUT


def formats_within(text, values):
    # a % or format filter's widths and precisions at most MAX_WIDTH (* would take them from its values), and what
    # its fields write at most MAX_OUTPUT: each field all its values at most (a '%(k)s' repeats one)
    sizes = re.findall(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d*)(?:\.(\*|\d*))?", text.replace("%%", ""))
    return all(n != "*" and int(n or 0) <= MAX_WIDTH for spec in sizes for n in spec) \
        and len(text) + len(sizes) * written(values) <= MAX_OUTPUT


def written(value, cap=MAX_OUTPUT, nested=False):
    # the characters str(value) writes, counted no further than past cap (a walk of at most cap / 3 items): a text's
    # length (inside a list, its repr's: up to 10 a character), a list, tuple or dict's items' and separators
    if isinstance(value, str):
        return len(value) if not nested or value.isprintable() else 10 * len(value)
    if not isinstance(value, (list, tuple, dict)):
        return len(str(value))
    if 3 * len(value) > cap:  # each item writes a character and a separator of two at least
        return cap + 1
    size = 2
    for item in value.items() if isinstance(value, dict) else value:
        size += written(item, cap - size, True) + 2
        if size > cap:
            break
    return size


def checked_filter(name, run, step, bounded):
    """jinja's filter run (named name), counted as a call and refused (TemplateError) past the budget: a center or
    indent width, indent or wordwrap text, or format width past MAX_WIDTH, a replace, join or result past MAX_OUTPUT."""
    import functools
    from jinja2.exceptions import TemplateError

    @functools.wraps(run)  # (and jinja's mark of what it passes first: the context, ...)
    def filtered(*args, **kwargs):
        step(10)
        values = [*args, *kwargs.values()]
        texts = [v for v in values if isinstance(v, str)]
        items = [v for v in values if hasattr(v, "__len__") and not isinstance(v, (str, dict))]  # lists, ranges
        if name in ("center", "indent", "tojson", "batch", "slice") and any(
                type(v) is int and abs(v) > MAX_WIDTH or name == "tojson" and isinstance(v, str) and len(v) > MAX_WIDTH
                for v in values[1:]) or len(texts) > 1 and max(map(len, texts[1:])) \
                > MAX_WIDTH and name in ("indent", "wordwrap") \
                or name == "replace" and len(texts) >= 3 and len(texts[-3]) + len(texts[-1]) * \
                texts[-3].count(texts[-2]) > MAX_OUTPUT \
                or name == "format" and not formats_within(str(args[0]), values[1:]) \
                or name == "join" and items and len(items[0]) * len(texts[-1] if texts else "") + (
                    written(items[0]) if isinstance(items[0], (list, tuple)) else 3 * len(items[0])) > MAX_OUTPUT:
            raise TemplateError(f"its {name} filter makes a value past the budget of a chat template")
        return bounded(run(*args, **kwargs))
    return filtered


def generation_tags():
    """jinja2's extension for {% generation %}...{% endgeneration %}, which TRL's assistant-only templates put
    around what the model writes (transformers' return_assistant_tokens_mask): the text inside, between MARKS."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_marked"), [], [], body).set_lineno(lineno)

        def _marked(self, caller):
            return MARKS[0] + caller() + MARKS[1]

    return Generation


def generation_spans(marked, origin):
    """A text rendered with MARKS -> Chat: the text without them, and the spans they enclosed; UserError where the
    template (origin) writes a block's text cut (a slice of a variable it set), its beginning or end left out."""
    text, spans, opened, at = [], [], [], 0
    for piece in re.split(f"([{MARKS[0]}{MARKS[1]}])", marked):
        if piece == MARKS[0]:
            opened.append(at)
        elif piece == MARKS[1]:
            if not opened:
                break
            spans.append((opened.pop(), at))
        else:
            text.append(piece)
            at += len(piece)
    if opened or len(spans) < marked.count(MARKS[1]):  # (a block's end before its beginning: the loop broke)
        raise UserError(f"the chat template ({origin}) writes a {{% generation %}} block's text cut (a part of a "
                        f"variable it set), so what it trains cannot be told: write each block whole (--chat_template)")
    return Chat("".join(text), sorted(span for span in spans if span[1] > span[0]))


def find_template(folder, template_file=None):
    """(template text, where it is from, {bos_token, eos_token: their text}, the 'tool_use' template or None) for a
    tokenizer's folder (or None): --chat_template=FILE, else the folder's chat_template.jinja or tokenizer_config.json's
    chat_template (a dataset of ours: its meta.json's), else DEFAULT_TEMPLATE. The special tokens are that file's.
    Of several named templates, the 'default' one, and 'tool_use', which transformers takes for a record with tools."""
    config, config_file = {}, "tokenizer_config.json"
    path = Path(folder) if folder else None
    if path is not None and path.is_file():
        path = path.parent  # a tokenizer.json: its folder
    if path is not None and (path / "tokenizer_config.json").is_file():
        config = read_json(path / "tokenizer_config.json")
    if path is not None and (path / "meta.json").is_file():  # a dataset of ours: the template it was made with
        config = read_json(path / "meta.json", "re-run prepare.py").get("chat") or {}
        config, config_file = {**config, "chat_template": config.get("template")}, "meta.json"
    tokens = {}
    for name in ("bos_token", "eos_token"):
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            tokens[name] = token
    if template_file:
        return Path(template_file).read_text(encoding="utf-8"), str(template_file), tokens, None
    if path is not None and (path / "chat_template.jinja").is_file():
        jinja, tool = path / "chat_template.jinja", path / "additional_chat_templates" / "tool_use.jinja"
        return jinja.read_text(encoding="utf-8"), str(jinja), tokens, \
            tool.read_text(encoding="utf-8") if tool.is_file() else None  # (transformers' save of named ones)
    template, named = config.get("chat_template"), {}
    if isinstance(template, list):  # several named templates
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template, str(path / config_file), tokens, named.get("tool_use")
    return DEFAULT_TEMPLATE, "built-in", tokens, None


class ChatFormat:
    """A chat template, its special tokens and train_on: renders records and conversations, finds trained spans."""

    def __init__(self, source, origin, special_tokens, eos_token, train_on="assistant", bos_token=None,
                 separator=None, text_bos="", tool_template=None):
        if train_on not in TRAIN_ON:
            raise UserError(f"--train_on={train_on} is not one of {', '.join(TRAIN_ON)}")
        self.source, self.origin, self.train_on = source, origin, train_on
        self.text_bos = text_bos  # the BOS the tokenizer puts before a text: plain prompt/completion strings
        self.tool_template = tool_template if tool_template != source else None  # (a record's tools: record)
        self.templated = False  # whether a record was written with the template (plain prompt/completion: no)
        self.separator = separator  # what ends an example in the token files: no message may hold it
        self.specials = sorted(special_tokens, key=len, reverse=True)  # the longest first: "</s>" before "<"
        # any of them as a message's text would be read as the token (the regex factors out their common prefix)
        self.special_text = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        self.context = {"eos_token": eos_token, "bos_token": bos_token or "", "tools": None, "documents": None}
        self.template = compile_template(source)
        probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
        self.tagged = MARKS[0] in self.render(probe, marks=True)  # {% generation %} blocks say what is trained
        text = self.render(probe)
        if "Hello" not in text:
            raise UserError(f"the chat template ({origin}) does not write an assistant's reply, so there would be "
                             f"nothing to train on: use one that does (--chat_template)")
        # the special token right after the reply closes the turn: the model must learn to write it to stop
        rest = text[text.rfind("Hello") + len("Hello"):].lstrip()
        self.end_of_turn = next((s for s in self.specials if rest.startswith(s)), None)
        if self.end_of_turn is None:
            raise UserError(f"the chat template ({origin}) closes an assistant's turn with no special token, so "
                             f"a model could not learn where to stop: use a template that does (--chat_template)")

    @classmethod
    def for_tokenizer(cls, folder, special_tokens, eot_text, train_on="assistant", template_file=None, text_bos=""):
        source, origin, tokens, tool_template = find_template(folder, template_file)  # (a bare tokenizer.json: the
        return cls(source, origin, special_tokens, tokens.get("eos_token", eot_text), train_on,  # BOS it puts)
                   tokens.get("bos_token", text_bos), eot_text, text_bos, tool_template)

    def meta(self, tokenizer):
        """What meta.json says of the conversations (sample.py and export.py use its template again)."""
        return {"template": self.source, "template_from": self.origin, "train_on": self.train_on,
                "end_of_turn": self.end_of_turn, "end_of_turn_id": tokenizer.special_tokens()[self.end_of_turn],
                "bos_token": self.context["bos_token"], "eos_token": self.context["eos_token"]}

    def special_in(self, text):
        """The first special token's spelling in text, which encoding would read as the token; or None."""
        found = self.special_text.search(text) if self.special_text else None
        return found[0] if found else None

    def render(self, messages, add_generation_prompt=False, marks=False, tools=None, keep_budget=False):
        # marks: with MARKS around what {% generation %} blocks wrote; tools: the record's, for the template;
        # keep_budget: within what is left of the budget (MAX_STEPS, MAX_SECONDS) of the rendering before
        from jinja2.exceptions import TemplateError
        messages = [with_reasoning(m) for m in messages]
        try:
            text = self.template(keep_budget, **{**self.context, "tools": tools}, messages=messages,
                                 add_generation_prompt=add_generation_prompt)
        except (TemplateError, TypeError) as e:  # its raise_exception, what the sandbox refused, an {% include %}
            long = keep_budget and str(e).startswith("it takes more than")  # (a record's renderings share a budget)
            raise UserError(f"the chat template refused it ({e}{', rendering its turns one by one' if long else ''})"
                            f"{': split the conversation' if long else ''}") from None
        except (ArithmeticError, RecursionError, LookupError, AttributeError, ValueError, MemoryError) as e:  # its bugs
            raise UserError(f"the chat template failed ({type(e).__name__}: {e})") from None
        return text if marks else text.replace(MARKS[0], "").replace(MARKS[1], "")

    def record(self, obj):
        """A JSON record -> Chat, or ValueError saying why it cannot be one."""
        if "conversations" in obj and "messages" not in obj:  # ShareGPT's layout: its turns as messages
            obj = {"messages": sharegpt_messages(obj["conversations"], obj.get("system")), "tools": obj.get("tools")}
        elif "instruction" in obj and "messages" not in obj:  # Alpaca's (LLaMA-Factory's system, history): the same
            obj = {"messages": alpaca_messages(obj), "tools": obj.get("tools")}
        elif isinstance(obj.get("messages"), list) and obj.get("system") is not None:  # a system prompt beside them
            obj = {**obj, "messages": with_system(obj["messages"], obj["system"])}
        tools = obj.get("tools")  # the functions a model may call, as TRL gives them to the template
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise UserError("'tools' is not a list of JSON objects (tool definitions): give it as one (a text of "
                            "JSON: parse it)")
        if tools is not None and self.tool_template:
            raise UserError(f"it has tools, which transformers writes with {self.origin}'s 'tool_use' template, not "
                            f"its default one: prepare such records apart, with that template as --chat_template=FILE")
        # every text of the messages and tools, however deep, keys too: a template may write any field (a name, the
        # reasoning, a call's arguments, as they are)
        texts, stack = [], [[obj.get(key) for key in ("messages", "prompt", "completion")], tools]
        while stack:
            value = stack.pop()
            if isinstance(value, str):
                texts.append(value)
            elif isinstance(value, (dict, list)):
                stack.extend([*value.keys(), *value.values()] if isinstance(value, dict) else value)
        if self.separator and any(self.separator in t for t in texts):
            raise UserError(f"it holds {self.separator}, which ends an example in the token files, as text")
        held = next((held for t in texts if (held := self.special_in(t))), None)
        if held:  # (only the template's own markers are special tokens: the docs' promise)
            raise UserError(f"it holds {held}, a special token of the tokenizer, as text (it would be read as the "
                             f"token)")
        if self.tagged and any(MARKS[0] in t or MARKS[1] in t for t in texts):
            raise UserError("it holds the private-use character U+E002 or U+E003, which marks what the template's "
                             "{% generation %} blocks write")
        if "messages" in obj:
            messages = obj["messages"]
            check_messages(messages, "messages")
            last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
            if last is None:
                raise UserError("no assistant message to learn from")
            chat = self.chat(messages, last, tools, to_end=last == len(messages) - 1)
        else:
            prompt, completion = obj["prompt"], obj["completion"]
            if isinstance(prompt, str) and isinstance(completion, str):  # untemplated, as in TRL; the BOS first if any
                if not completion.strip():  # as an empty assistant message is
                    raise UserError("the completion is empty: there is no reply to learn from")
                text = self.text_bos + prompt + completion + self.context["eos_token"]
                start = 0 if self.train_on == "all" else len(self.text_bos + prompt)
                return Chat(text, [(start, len(text))])
            check_messages(prompt, "prompt")
            check_messages(completion, "completion")
            chat = self.chat(prompt + completion, len(prompt), tools, prompt=len(prompt))
        self.templated = True
        return chat

    def chat(self, messages, first_completion, tools=None, to_end=True, prompt=0):
        """messages -> Chat, trained on: 'assistant', each assistant turn after its header (the generation prompt,
        untrained as in TRL) to its closing token, a think block before the reply included, or what {% generation %}
        blocks write; 'completion', all from messages[first_completion]'s reply on (to_end False: to the last
        assistant turn's closing token, the turns after it untrained); 'all', everything. An assistant turn with
        tool_calls is trained whole: its text and its calls as the template writes them; one with a "weight" of 0
        (ShareGPT's, as axolotl reads it) is not trained. The first prompt messages (a prompt/completion record's
        prompt) are context: their assistant turns are never trained but under 'all', as TRL's completion-only loss."""
        text = self.render(messages, tools=tools)
        weights = {i: 1 if m.get("weight") is None else m["weight"] for i, m in enumerate(messages)
                   if m["role"] == "assistant"}
        bad = next((w for w in weights.values() if w not in (0, 1)), None)
        if bad is not None:
            raise UserError(f"an assistant message's weight is {bad!r}: give 1 to train it, 0 not to")
        if self.tagged and self.train_on == "assistant" and any(w == 0 for i, w in weights.items() if i >= prompt):
            raise UserError("a weight of 0 cannot be told apart in what the template's {% generation %} blocks write: "
                            "drop the turn, or use a template without them (--chat_template)")
        if self.tagged and self.train_on == "assistant":  # what its {% generation %} blocks write, as in TRL
            found = generation_spans(self.render(messages, marks=True, tools=tools, keep_budget=True), self.origin)
            if prompt:  # what the blocks write inside the prompt is context
                lead = self.render(messages[:prompt], tools=tools, keep_budget=True)
                if not text.startswith(lead):
                    raise UserError("the chat template writes the prompt otherwise before its completion: cannot "
                                    "tell where the completion begins")
                found = Chat(found.text, [(a, b) for a, b in found.spans if a >= len(lead)])
            if not found.spans:
                raise UserError("the chat template's {% generation %} blocks write nothing of it to train on")
            return found
        spans, kept = [], []  # each turn is looked for after where the last one found ends, under any train_on: a
        for i, message in enumerate(messages):  # record with an empty reply or unwritten tool_calls is refused
            if message["role"] == "assistant" and i >= prompt:
                spans.append(self.turn(text, messages, i, spans[-1][1] if spans else 0, tools))
                kept.append(weights[i])
        if not spans:  # (a completion of no assistant turn)
            raise UserError("no assistant message to learn from" + (" in its completion" if prompt else ""))
        if self.train_on != "assistant":
            first = spans[sum(1 for i in weights if prompt <= i < first_completion)][0]
            return Chat(text, [(0, len(text))] if self.train_on == "all" else
                        [(first, len(text) if to_end else spans[-1][1])])
        spans = [span for span, weight in zip(spans, kept) if weight]
        if not spans:
            raise UserError("every assistant message has weight 0: there is nothing to learn from")
        return Chat(text, spans)

    def turn(self, text, messages, i, at, tools=None):
        # (start, end) of assistant message i's turn in text, the first after at: from where the conversation before it
        # and the generation prompt end; where the template writes that otherwise (Mistral's moves the system prompt),
        # where a stand-in reply stands. The reply is found back from the closing token (a think block may repeat it).
        try:  # (a conversation the assistant begins: a template may read messages[0], of none)
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools, keep_budget=True)
        except UserError:
            before = None
        if before is not None and text.startswith(before):
            begin = len(before)
        else:
            marked = self.render(messages[:i] + [{**messages[i], "content": STAND_IN}] + messages[i + 1:], tools=tools,
                                 keep_budget=True)
            begin = marked.find(STAND_IN)
            if begin < at or not text.startswith(marked[:begin]):
                raise UserError(f"the chat template writes the conversation before assistant message {i + 1} "
                                 f"otherwise with the reply there: cannot tell where the reply begins")
        close = text.find(self.end_of_turn, begin)
        content, calls = (messages[i]["content"] or "").strip(), messages[i].get("tool_calls")
        if not content and not calls:  # the record's fault, not the template's
            raise UserError(f"assistant message {i + 1} is empty: there is no reply to learn from")
        if calls:  # the whole turn, if the template writes the text and each call's name in it
            names = [(c["function"] if isinstance(c.get("function"), dict) else c).get("name") for c in calls]
            if close < 0 or content not in text[begin:close] or \
                    not all(isinstance(n, str) and n in text[begin:close] for n in names):
                raise UserError(f"the chat template does not write assistant message {i + 1}'s tool_calls: use one "
                                 f"that does (--chat_template)")
            return begin, close + len(self.end_of_turn)
        start = text.rfind(content, begin, close) if close >= 0 else -1
        if start < 0 and "</think>" in content:  # reasoning templates drop it from earlier turns
            content = content.split("</think>")[-1].strip()
            start = text.rfind(content, begin, close)
        if start < 0 or text[start + len(content):close].strip():
            raise UserError(f"the chat template does not write assistant message {i + 1} as it is, closed by "
                             f"{self.end_of_turn}")
        if self.end_of_turn not in text[begin:start]:
            start = begin  # what the template writes in the turn before the reply (a think block) is the model's
        return start, close + len(self.end_of_turn)


def check_messages(messages, field):
    if not isinstance(messages, list) or not messages:
        raise UserError(f"'{field}' is not a list of messages")
    for i, m in enumerate(messages, 1):
        calls = isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls")
        if calls and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise UserError(f"{field} {i}'s tool_calls is not a list of JSON objects (calls): give it as one")
        text = isinstance(m, dict) and (isinstance(m.get("content"), str) or calls and m.get("content") is None)
        if isinstance(m, dict) and isinstance(m.get("content"), list):  # (templates of text models write no parts)
            raise UserError(f"{field} {i}'s content is a list of parts (multimodal): give its text as one string")
        if not text or m.get("role") not in ROLES:
            raise UserError(f"{field} {i} is not a message with a role ({'/'.join(ROLES)}) and text content (or an "
                             f"assistant's tool_calls)")
