"""Chat templates: a conversation (a list of messages) -> the one prompt string the model was trained on.

Every chat model ships a Jinja template (GGUF `tokenizer.chat_template`, or `chat_template` in a
Hugging Face tokenizer_config.json) that writes the role markers it expects, e.g. ChatML:

    <|im_start|>system\\nYou are ...<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n

The last line - the *generation prompt* - opens the assistant's turn, so the model's next tokens are
its answer. Templates come from model files, i.e. from strangers: we render them in Jinja's
immutable sandbox, with the same environment Hugging Face `transformers` uses (trim_blocks,
lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII text, `raise_exception`), so that our
prompt is the one the model was trained with, character for character.

Whose text is it? The template's markup ("<|im_start|>", role names) is the server's; a message's
content is the user's. If the whole prompt were tokenized with special-token matching, a user who
types "<|im_end|>\n<|im_start|>system\n..." would forge a system turn. `render_chat_parts` keeps
the two apart: contents are tokenized as plain text, only the template's own text may hold
special tokens.
"""
from __future__ import annotations

import json
import secrets
from collections.abc import Collection, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The ChatML layout, for models that carry no template of their own.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str) -> jinja2.Template:
    """Compile once per template string; templates are reused for every request."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from None


def validate_messages(messages: Sequence[dict]) -> list[dict]:
    """Check a conversation; return copies with OpenAI-style text parts joined into one string."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"messages[{i}] has no 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}] has role {message['role']!r}; expected one of {', '.join(ROLES)}")
        if "content" not in message:
            raise ValueError(f"messages[{i}] has no 'content'")
        content = message["content"]
        if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) "
                                 "are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        checked.append({**message, "content": content})
    return checked


def render_chat(messages: Sequence[dict], template: str | None = None, add_generation_prompt: bool = True,
                **special: Any) -> str:
    """Render a conversation with a chat template (ChatML when `template` is None).

    `special` reaches the template as variables - usually `bos_token` and `eos_token`, which many
    templates write out. Encode the result with `tokenizer.encode(prompt, add_bos=False)`.
    """
    checked = validate_messages(messages)
    compiled = compile_template(CHATML_TEMPLATE if template is None else template)
    try:
        # tools/documents are always defined, as transformers defines them (templates test for them).
        variables = {"tools": None, "documents": None, **special}
        return compiled.render(messages=checked, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template rejected the conversation: {e}") from None


def render_chat_parts(messages: Sequence[dict], template: str | None = None, add_generation_prompt: bool = True,
                      special_tokens: Collection[str] = (), **special: Any) -> list[tuple[str, bool]]:
    """The rendered prompt as `(text, special)` parts: `special` is False for message contents,
    which the tokenizer must encode as plain text (`Tokenizer.encode_parts`). The texts joined are
    exactly `render_chat(...)`.

    How: the template is rendered a second time with each content replaced by a unique marker, and
    the markers show where the contents sit. A template that rewrites contents (trims them, say)
    leaves the two renderings different; then the prompt is taken whole, which is safe only if no
    content holds one of `special_tokens` - otherwise the conversation is refused.
    """
    checked = validate_messages(messages)
    text = render_chat(checked, template, add_generation_prompt, **special)
    nonce = secrets.token_hex(8)
    markers = {i: f"\ue000{nonce}:{i}\ue001" for i, m in enumerate(checked) if m["content"]}
    marked = render_chat([{**m, "content": markers.get(i, m["content"])} for i, m in enumerate(checked)],
                         template, add_generation_prompt, **special)
    parts, rest = [], marked
    for i, marker in markers.items():
        before, found, rest = rest.partition(marker)
        if not found or marker in rest:
            break
        parts += [(before, True), (checked[i]["content"], False)]
    else:
        parts.append((rest, True))
        if "".join(t for t, _ in parts) == text:
            return [(t, s) for t, s in parts if t]
    for i, m in enumerate(checked):
        if hit := next((t for t in special_tokens if t in m["content"]), None):
            raise ValueError(f"messages[{i}].content holds the special token {hit!r}, and this model's chat template "
                             "rewrites contents, so it cannot be kept apart as plain text")
    return [(text, True)]
