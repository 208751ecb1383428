"""Record layouts: which fields are prompt and response, how a user's field names map onto them, chats and
their templates. Imports nothing of tunekit, so the config can check `fields` against it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

# Field layouts we recognise, tried in order: (prompt fields, response field). `messages` is a chat.
LAYOUTS = [(("question",), "answer"), (("prompt",), "response"), (("instruction", "input"), "output"),
           (("prompt",), "completion"), ((), "messages"), ((), "text")]


# `instruction` + `instances` (a list of {input, output} objects, as Self-Instruct and Super-NaturalInstructions
# store tasks) is expanded by `load_records` into one instruction/input/output sample per instance.
INSTANCES = ("instruction", "instances")


# What `fields` may map onto: (the fields a layout needs, the ones it may have). For `instances`, `input` and
# `output` name the keys inside each instance.
WHOLE_LAYOUTS = [(frozenset(p[:1]) | {r}, frozenset(p[1:])) for p, r in LAYOUTS] + [
    (frozenset(INSTANCES), frozenset({"input", "output"}))]


FIELD_NAMES = sorted(set().union(*(need | may for need, may in WHOLE_LAYOUTS)))


CHAT_ROLES = ("system", "user", "assistant")


SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}  # {"from", "value"} turns


# How chats are rendered: the tokenizer's template when it has one (auto), tunekit's `<|role|>` one (builtin),
# the tokenizer's or an error (tokenizer), ChatML (for base models without a template), or a Jinja template
# (given as a file or as the text itself).
CHAT_TEMPLATES = ("auto", "builtin", "tokenizer", "chatml")


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class DataError(ValueError):
    """Bad input data; the message names the file, line or field, and what to do."""


class ChatTemplateError(DataError):
    """The chat template failed to render a conversation (a Jinja error, the sandbox's SecurityError)."""


def parse_fields(spec: str) -> dict[str, str]:
    """`fields` text -> {layout field: the data's field}. `'prompt=question,response=answer'` means: the data's
    `question` is the layout's `prompt`, its `answer` the `response`. The names must make one whole layout
    (`WHOLE_LAYOUTS`); a DataError says what is wrong otherwise."""
    mapping: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        target, eq, name = (x.strip() for x in part.partition("="))
        if not (eq and target and name):
            raise DataError(f"{part!r} is not LAYOUT_FIELD=YOUR_FIELD (e.g. prompt=question,response=answer)")
        if target not in FIELD_NAMES:
            raise DataError(f"{target!r} is not a layout field; the layout fields are {', '.join(FIELD_NAMES)}")
        if target in mapping or name in mapping.values():
            raise DataError(f"{part!r}: each layout field and each of your fields may appear once")
        mapping[target] = name
    if mapping and not any(need <= set(mapping) <= need | may for need, may in WHOLE_LAYOUTS):
        layouts = "; ".join("+".join(sorted(need)) + "".join(f" [+{m}]" for m in sorted(may))
                            for need, may in WHOLE_LAYOUTS)
        raise DataError(f"{'+'.join(mapping)} is not one whole layout; map every field of one of: {layouts}")
    return mapping


def detect_layout(columns: list[str], where: str = "dataset") -> tuple[tuple[str, ...], str]:
    for prompt_fields, response in LAYOUTS:
        if response in columns and all(f in columns for f in prompt_fields[:1]):
            return prompt_fields, response
    known = "; ".join("/".join(p + (r,)) for p, r in LAYOUTS) + "; " + "/".join(INSTANCES)
    raise DataError(f"{where}: has fields {sorted(columns)}, none of the known layouts ({known}). "
                    "Map your fields onto one with --fields LAYOUT_FIELD=YOUR_FIELD,... (e.g. "
                    "--fields prompt=q,response=a; the README's 'Your own data' lists the layouts), "
                    "or rename them in the file.")


def format_prompt(rec: dict, prompt_fields: tuple[str, ...]) -> str:
    if not prompt_fields:
        return ""
    if prompt_fields == ("question",):
        return f"Question: {rec['question'].strip()}\nAnswer: "
    if prompt_fields == ("instruction", "input"):
        extra = (rec.get("input") or "").strip()
        return f"{rec['instruction'].strip()}\n{extra}\n\n" if extra else f"{rec['instruction'].strip()}\n\n"
    return rec[prompt_fields[0]]


def record_text(rec: dict, prompt_fields: tuple[str, ...], response_field: str) -> str:
    """All the text of one record (prompt and response, or every chat turn): what a tokenizer trains on."""
    if response_field == "messages":
        return "\n".join(m.get("content") or "" for m in rec.get("messages") or [] if isinstance(m, dict))
    fields = (*prompt_fields[:1], response_field)
    if not all(isinstance(rec.get(f), str) for f in fields):
        return ""
    return format_prompt(rec, prompt_fields) + rec[response_field]


def _json_type(value) -> str:
    """A value's type as the file spells it: 'a number', 'a list', ..."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {list: "a list", tuple: "a list", dict: "an object", str: "text"}.get(type(value), type(value).__name__)


def _check_text(value, name: str, where: str, rec: dict | None = None) -> None:
    """A DataError unless `value` is non-blank text: missing, of another type (said, with the type wanted) or
    blank."""
    if value is None:
        have = f" (it has {sorted(k for k, v in rec.items() if v is not None)})" if rec is not None else ""
        raise DataError(f"{where}: missing field '{name}'{have}. Fix or remove the record.")
    if not isinstance(value, str):
        example = f" such as {json.dumps(str(value))}" if isinstance(value, (int, float)) else ""
        raise DataError(f"{where}: '{name}' is {_json_type(value)} ({json.dumps(value, default=str)[:60]}), "
                        f"expected text (a JSON string{example}). Convert the field to text or remove the record.")
    if not value.strip():
        raise DataError(f"{where}: empty '{name}'. Fill or remove the record.")


def _check_fields(rec: dict, fields: tuple[str, ...], where: str) -> None:
    for name in fields:
        _check_text(rec.get(name), name, where, rec)


def _check_messages(messages, where: str) -> list[dict]:
    """The turns as plain {role, content} dicts, or a DataError naming the record and the turn. ShareGPT's
    {from, value} turns (from: human, gpt, system) are read as {role, content}."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects.")
    turns = []
    for j, m in enumerate(messages, 1):
        if isinstance(m, dict) and m.get("role") is None and m.get("from") is not None:
            m = {"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m.get("value")}
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise DataError(f"{where}: message {j} has role {role!r}; allowed roles are {', '.join(CHAT_ROLES)}. "
                            "Rename the role (e.g. 'human' -> 'user', 'gpt' -> 'assistant') or drop the message.")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise DataError(f"{where}: message {j} ({role}): 'content' is {_json_type(content)}, expected text. "
                            "Convert it to text or remove the message.")
        if content is None or (role != "system" and not content.strip()):
            raise DataError(f"{where}: message {j} ({role}) has an empty or non-text 'content'. "
                            "Fill or remove the message.")
        turns.append({"role": role, "content": content})
    if not any(t["role"] == "assistant" for t in turns):
        raise DataError(f"{where}: no assistant message, so nothing to train on. Add one or remove the record.")
    return turns


def split_at_markers(text: str, response_template: str,
                     instruction_template: str = "") -> list[tuple[str, bool]] | None:
    """(piece, trained) pieces of one single-text record, or None when `response_template` is not in it.

    As TRL's completion-only collator: without `instruction_template`, what follows the last response marker
    trains; with it, each span from a response marker to the next instruction marker. The markers themselves
    are masked. Matching the text, not token ids, finds a marker whatever tokens its neighbours make of it."""
    ends = [m.end() for m in re.finditer(re.escape(response_template), text)]
    if not ends:
        return None
    if not instruction_template:
        return [(text[:ends[-1]], False), (text[ends[-1]:], True)]
    starts = [m.start() for m in re.finditer(re.escape(instruction_template), text)]
    pieces, pos = [], 0
    for end in ends:
        if end - len(response_template) < pos:  # a marker inside the span already trained
            continue
        stop = next((s for s in starts if s >= end), len(text))
        pieces += [(text[pos:end], False), (text[end:stop], True)]
        pos = stop
    return pieces + [(text[pos:], False)] if pos < len(text) else pieces  # EOS trains after a trained end


def read_chat_template(spec: str) -> str:
    """`chat_template` as text: a named choice or a Jinja template as it is, a file by its contents."""
    if spec in CHAT_TEMPLATES or "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"chat_template {spec!r}: no such file. Use {', '.join(CHAT_TEMPLATES)}, a Jinja "
                        "template file or the template's text.")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"chat_template {spec}: not UTF-8 (byte {e.start}). Re-encode the file as UTF-8.") from None


def resolve_chat_template(spec: str, tokenizer):
    """The Jinja template that renders chats (a string, or the tokenizer's own), or None for the built-in."""
    spec, own = read_chat_template(spec), getattr(tokenizer, "chat_template", None) or None
    if spec == "tokenizer" and not own:
        raise DataError("chat_template 'tokenizer': this tokenizer has no chat template. Use auto or builtin "
                        "(tunekit's <|role|> template), chatml, or a Jinja template file.")
    return {"auto": own, "tokenizer": own, "builtin": None, "chatml": CHATML}.get(spec, spec)
