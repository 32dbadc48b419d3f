"""What kvfold's front door reads of an OpenAI request body, checked. Pure; no Ray.

    parse_completion(body)   POST /v1/completions       -> OpenAIRequest
    parse_chat(body)         POST /v1/chat/completions  -> OpenAIRequest
    BadRequest               what was wrong, for a 400 in OpenAI's error shape

The front door forwards the body unchanged: it reads only what it needs to count the
request's blocks (the prompt, `max_tokens`, `n`) and whether to stream. A field it does not
know travels to the engine, which judges it. A body kvfold cannot count is refused here,
before anything is promised.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvfold.errors import KVFoldError

COMPLETIONS = "completions"
CHAT = "chat"


class BadRequest(KVFoldError, ValueError):
    """A request body the front door refuses (HTTP 400); the message names the field."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(f"{param}: {message}")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One request as the front door counts it. Exactly one of `prompt_ids` (a token-id
    prompt, as given), `prompt_text` (a text prompt) or `messages` (a chat) is set."""

    kind: str  # COMPLETIONS or CHAT
    body: Mapping[str, Any]
    max_tokens: int | None  # None: up to the model's limit
    n: int = 1
    stream: bool = False
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    add_special_tokens: bool | None = None  # None: the engine's default for the kind
    chat_options: Mapping[str, Any] = field(default_factory=dict)


def parse_completion(body: object) -> OpenAIRequest:
    """A /v1/completions body: one prompt, text or token ids (a list of one prompt is
    taken as that prompt)."""
    b = _object(body)
    prompt = b.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    prompt_ids: tuple[int, ...] | None = None
    prompt_text: str | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt", "allowed: a non-empty string or list of token ids")
        prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        prompt_ids = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(
            "prompt", f"a batch of {len(prompt)} prompts; allowed: one prompt per request"
        )
    else:
        raise BadRequest(
            "prompt",
            f"got {_show(prompt)}; allowed: a non-empty string or list of non-negative "
            "int token ids",
        )
    return OpenAIRequest(
        kind=COMPLETIONS,
        body=b,
        max_tokens=_max_tokens(b, ("max_tokens",)),
        n=_n(b),
        stream=_flag(b, "stream", False),
        prompt_ids=prompt_ids,
        prompt_text=prompt_text,
        add_special_tokens=_optional_flag(b, "add_special_tokens"),
    )


def parse_chat(body: object) -> OpenAIRequest:
    """A /v1/chat/completions body: `messages`, each a role and a content (a string or
    text parts); `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`
    and `add_special_tokens` go to the template as vLLM takes them."""
    b = _object(body)
    messages = b.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", f"got {_show(messages)}; allowed: a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]", "allowed: an object with a string 'role'")
        if not _content_ok(m.get("content")):
            raise BadRequest(
                f"messages[{i}].content",
                "allowed: a string or a list of {'type': 'text', 'text': ...} parts",
            )
    kwargs = b.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs", "allowed: an object")
    options = {
        "add_generation_prompt": _flag(b, "add_generation_prompt", True),
        "continue_final_message": _flag(b, "continue_final_message", False),
        **kwargs,
    }
    return OpenAIRequest(
        kind=CHAT,
        body=b,
        max_tokens=_max_tokens(b, ("max_completion_tokens", "max_tokens")),
        n=_n(b),
        stream=_flag(b, "stream", False),
        messages=tuple(messages),
        add_special_tokens=_optional_flag(b, "add_special_tokens"),
        chat_options=options,
    )


def _content_ok(content: object) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    )


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise BadRequest("body", f"got {type(body).__name__}; allowed: a JSON object")
    return body


def _is_token(t: object) -> bool:
    return type(t) is int and t >= 0


def _max_tokens(b: Mapping[str, Any], names: Sequence[str]) -> int | None:
    for name in names:
        value = b.get(name)
        if value is None:
            continue
        if type(value) is not int or value <= 0:
            raise BadRequest(name, f"got {_show(value)}; allowed: a positive int")
        return value
    return None


def _n(b: Mapping[str, Any]) -> int:
    n = b.get("n", 1)
    if n is None:
        return 1
    if type(n) is not int or n <= 0:
        raise BadRequest("n", f"got {_show(n)}; allowed: a positive int")
    return n


def _flag(b: Mapping[str, Any], name: str, default: bool) -> bool:
    value = _optional_flag(b, name)
    return default if value is None else value


def _optional_flag(b: Mapping[str, Any], name: str) -> bool | None:
    value = b.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise BadRequest(name, f"got {_show(value)}; allowed: true or false")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["CHAT", "COMPLETIONS", "BadRequest", "OpenAIRequest", "parse_chat", "parse_completion"]
