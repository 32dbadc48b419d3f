"""A request's prompt token ids, as the engine will compute them. No Ray.

    PromptTokenizer(model_dir)   the model's own tokenizer files, loaded as vLLM loads them
      .ids(request)              token ids for an OpenAIRequest (kvfold.serving.openai_body)

vLLM tokenizes with Hugging Face `transformers` from the model's directory: a text prompt
with the tokenizer's special tokens added (`add_special_tokens`, default true); a chat by
rendering the model's chat template to text (`add_generation_prompt`, default true; the
request's `chat_template_kwargs`) and tokenizing that without adding special tokens again
(the template writes them). The front door does the same with the same files, so the blocks
it counts and the prefix it matches are the engine's (`tests/engines/test_front_door.py`
holds the two against the ids the engine returns).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvfold.serving.openai_body import CHAT, BadRequest, OpenAIRequest


class PromptTokenizer:
    """The tokenizer and chat template in `model_dir` (transformers is imported here, on
    first use: the front door's replicas need it, kvfold's other processes do not)."""

    def __init__(self, model_dir: str) -> None:
        root = Path(model_dir)
        if not ((root / "tokenizer.json").is_file() or (root / "tokenizer_config.json").is_file()):
            raise ValueError(
                f"model_dir={model_dir!r}: no tokenizer.json or tokenizer_config.json there; "
                "allowed: the model's directory, as the engine was started with"
            )
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self._tok: Any = AutoTokenizer.from_pretrained(model_dir)

    def ids(self, request: OpenAIRequest) -> list[int]:
        """The prompt's token ids: as given, or tokenized as the engine will."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        if request.kind == CHAT:
            text = self.chat_text(request.messages or (), request.chat_options)
            add_special = bool(request.add_special_tokens)  # vLLM's chat default: False
        else:
            text = request.prompt_text or ""
            add_special = request.add_special_tokens is not False  # completions: True
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special)
        if not ids:
            raise BadRequest("prompt", "tokenizes to no tokens")
        return ids

    def chat_text(self, messages: object, options: Mapping[str, Any]) -> str:
        """The chat rendered by the model's template, as text."""
        conversation = [_flatten(m) for m in messages]  # type: ignore[attr-defined]
        from jinja2 import TemplateError  # transformers' templates are jinja2's

        try:
            text: str = self._tok.apply_chat_template(conversation, tokenize=False, **options)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            # the template's own refusal (a bad role order, say: raise_exception in the
            # template), a model with no template (ValueError), or messages it cannot read
            raise BadRequest("messages", f"the chat template refused them: {e}") from e
        return text


def _flatten(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of text parts becomes one string, as vLLM joins
    them for a text-only model (with newlines)."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(p["text"] for p in content)
    elif content is None:
        out["content"] = ""
    return out


__all__ = ["PromptTokenizer"]
