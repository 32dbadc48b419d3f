"""What the front door reads of an OpenAI body (kvfold.serving.openai_body) and the
front door's settings: what it counts, and a clear refusal naming the field otherwise."""

from __future__ import annotations

from typing import Any

import pytest

from kvfold.serving.openai_body import CHAT, COMPLETIONS, BadRequest, parse_chat, parse_completion
from kvfold.serving.settings import FrontDoorSettings


def test_a_completion_is_read_as_sent() -> None:
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 7, "stream": True, "seed": 3}
    r = parse_completion(body)
    assert (r.kind, r.prompt_ids, r.max_tokens, r.n, r.stream) == (
        COMPLETIONS,
        (1, 2, 3),
        7,
        1,
        True,
    )
    assert r.body is body  # forwarded unchanged, unknown fields included
    r = parse_completion({"prompt": ["hello"]})  # a batch of one is that prompt
    assert (r.prompt_text, r.max_tokens, r.add_special_tokens) == ("hello", None, None)


def test_a_chat_is_read_with_its_template_options() -> None:
    r = parse_chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 5,
            "max_tokens": 9,
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    assert (r.kind, r.max_tokens) == (CHAT, 5)  # max_completion_tokens wins, as in OpenAI's API
    assert r.chat_options == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "enable_thinking": False,
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], "body"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 2.0]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens"),
        ({"prompt": [1], "max_tokens": "5"}, "max_tokens"),
        ({"prompt": [1], "n": 0}, "n"),
        ({"prompt": [1], "stream": "yes"}, "stream"),
    ],
)
def test_a_completion_kvfold_cannot_count_is_refused_by_name(body: Any, param: str) -> None:
    with pytest.raises(BadRequest, match=f"^{param}: ") as e:
        parse_completion(body)
    assert e.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3},
         "chat_template_kwargs"),
    ],
)  # fmt: skip
def test_a_chat_kvfold_cannot_count_is_refused_by_name(body: Any, param: str) -> None:
    with pytest.raises(BadRequest, match=rf"^{param.replace('[', '.').replace(']', '.')}: "):
        parse_chat(body)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"engine_urls": ()}, r"engine_urls=\(\)"),
        ({"engine_urls": ("127.0.0.1:8000",)}, r"engine_urls\[0\]='127.0.0.1:8000'"),
        ({"engine_urls": ("http://h:1/v1",)}, r"no path"),
        ({"policy": "random"}, "policy='random'"),
        ({"queue_limit": -1}, "queue_limit=-1"),
        ({"queue_timeout_s": 0}, "queue_timeout_s=0"),
        ({"num_replicas": 0}, "num_replicas=0"),
        ({"http_port": 0}, "http_port=0"),
        ({"max_running_per_engine": 0}, "max_running_per_engine=0"),
        ({"ingress": "haproxy"}, "ingress='haproxy'"),
        ({"ingress": "door", "num_replicas": 2, "shared_door": True}, "ingress='door' with"),
        ({"ingress": "door", "shared_door": True}, "ingress='door' with"),
    ],
)
def test_front_door_settings_name_what_is_wrong(kwargs: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {"engine_urls": ("http://127.0.0.1:8001",), "model_dir": "m"}
    with pytest.raises(ValueError, match=match):
        FrontDoorSettings(**{**base, **kwargs})
    assert FrontDoorSettings(**base).on_loopback
