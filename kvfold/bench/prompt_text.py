"""One prompt, two forms: bench-serve's prompts as token ids and as text that the engine's
tokenizer turns into exactly those ids. A router that reads text (Ray Serve LLM's
`PrefixCacheAffinityRouter` matches characters, and fails on token ids) then gets the same
requests as one that reads ids. No Ray.

    WordVocab.of(model_dir)     the model's whole-word tokens and its first token (BOS)
      .vocab, .bos
    with_text(requests, model_dir) -> the requests, each with its text, checked

A whole-word token is one that decodes to " word" and that the tokenizer encodes back to
itself alone; with a byte-level BPE, words split at spaces, so a run of such tokens is
its own tokenization. The tokenizer puts BOS first on text, so the ids start with it too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvfold.bench.bench_trace import ServeRequest

MIN_WORDS = 16


def _tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)  # as vLLM loads it


@dataclass(frozen=True)
class WordVocab:
    vocab: tuple[int, ...]  # whole-word token ids, ascending
    bos: int | None  # the token the tokenizer puts first on text, if any

    @classmethod
    def of(cls, model_dir: str) -> WordVocab:
        tok = _tokenizer(model_dir)
        words = []
        for i in range(len(tok)):
            text = tok.decode([i])
            whole = len(text) > 1 and text[0] == " " and text[1:].isalpha()
            if whole and tok.encode(text, add_special_tokens=False) == [i]:
                words.append(i)
        if len(words) < MIN_WORDS:
            raise ValueError(
                f"model_dir={model_dir!r}: {len(words)} whole-word tokens; allowed: a "
                f"tokenizer with >= {MIN_WORDS} (a byte-level BPE with words in its vocabulary)"
            )
        first = tok.encode("", add_special_tokens=True)
        return cls(tuple(words), first[0] if first else None)


def with_text(requests: Sequence[ServeRequest], model_dir: str) -> list[ServeRequest]:
    """Each request with its prompt's text; the text is checked to tokenize to the ids."""
    tok = _tokenizer(model_dir)
    out = []
    bos = tok.encode("", add_special_tokens=True)
    for r in requests:
        ids = list(r.prompt)
        body = ids[len(bos) :] if bos and ids[: len(bos)] == bos else ids
        text = tok.decode(body)
        if tok.encode(text, add_special_tokens=True) != ids:
            raise ValueError(
                f"request {r.request_id}: its text does not tokenize back to its "
                f"{len(ids)} ids; allowed: prompts drawn from WordVocab.of(model_dir)"
            )
        out.append(dataclasses.replace(r, text=text))
    return out


__all__ = ["WordVocab", "with_text"]
