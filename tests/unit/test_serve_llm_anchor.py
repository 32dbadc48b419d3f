"""bench-serve's Ray Serve LLM arms, their pure parts: prompts that are both token ids and
the text that tokenizes to them (the model's own tokenizer, as vLLM loads it), the replicas'
engine arguments equal to bench-serve's own engines', and vLLM's counters read from Ray's
metrics page. The application itself runs in `kvfold bench-serve --arms serve_llm_*`."""

import argparse
import dataclasses
import json
import pathlib
import random

import pytest

from kvfold.bench.bench_trace import ServeRequest, serve_requests
from kvfold.bench.prompt_text import WordVocab, with_text
from kvfold.bench.serve_llm import ServeLlmApp, engine_kwargs_of, ray_vllm_totals

MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "examples" / "models" / "small-llama")


@pytest.fixture(scope="module")
def words() -> WordVocab:
    return WordVocab.of(MODEL)


def _trace(tmp_path: pathlib.Path) -> pathlib.Path:
    """Mooncake rows: three share their first two hash ids, one has its own."""
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 8, "hash_ids": [1, 2, 3]},
        {"timestamp": 100, "input_length": 1400, "output_length": 8, "hash_ids": [1, 2, 4]},
        {"timestamp": 200, "input_length": 900, "output_length": 8, "hash_ids": [5, 6]},
        {"timestamp": 300, "input_length": 1536, "output_length": 8, "hash_ids": [1, 2, 7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_prompt_of_whole_words_is_text_that_tokenizes_to_its_ids(
    words: WordVocab, tmp_path: pathlib.Path
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    assert words.bos == tok.bos_token_id and len(words.vocab) >= 16
    requests = serve_requests(
        _trace(tmp_path), tokens_per_hash=32, vocab=words.vocab, first_token=words.bos
    )
    texted = with_text(requests, MODEL)
    for r in texted:
        assert r.prompt[0] == words.bos and set(r.prompt[1:]) <= set(words.vocab)
        assert tok.encode(r.text) == list(r.prompt)  # what the engine computes from the text
    # equal hash ids stay equal prefixes, in ids and in text alike
    a, b, c, d = texted
    assert a.prompt[: 1 + 64] == b.prompt[: 1 + 64] == d.prompt[: 1 + 64] != c.prompt[: 1 + 64]
    assert a.prompt[1 + 64 : 1 + 96] != b.prompt[1 + 64 : 1 + 96]
    assert a.text[:100] == b.text[:100] != c.text[:100]


def test_a_prompt_whose_text_tokenizes_otherwise_is_refused(words: WordVocab) -> None:
    rng = random.Random(3)
    ids = (words.bos, *(rng.randrange(3, 1024) for _ in range(200)))
    assert words.bos is not None
    with pytest.raises(ValueError, match="does not tokenize back"):
        with_text([ServeRequest("r0", 0.0, ids, 4)], MODEL)


def test_a_vocabulary_too_small_is_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="distinct ids"):
        serve_requests(_trace(tmp_path), vocab=[5, 6, 7])


def test_serve_llms_replicas_get_the_engines_own_arguments() -> None:
    from kvfold.bench.serve_runner import engine_settings
    from kvfold.engines.vllm_server import VLLMServer

    args = argparse.Namespace(
        engine_python="/bin/sh", model_dir=MODEL, blocks=1024, max_num_seqs=6,
        max_model_len=65536,  # past the model's own: through --hf-overrides
    )  # fmt: skip
    settings = engine_settings(args)
    server = VLLMServer(settings)
    kwargs = engine_kwargs_of(settings, server.kv_cache_memory_bytes)
    argv = server.command()
    flags = {
        "block_size": "--block-size", "kv_cache_memory_bytes": "--kv-cache-memory-bytes",
        "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
        "dtype": "--dtype", "seed": "--seed", "load_format": "--load-format",
    }  # fmt: skip
    for key, flag in flags.items():
        assert str(kwargs[key]) == argv[argv.index(flag) + 1], key
    switches = {
        "enable_prefix_caching": "--enable-prefix-caching", "enforce_eager": "--enforce-eager",
        "enable_prompt_tokens_details": "--enable-prompt-tokens-details",
    }  # fmt: skip
    for key, flag in switches.items():
        assert kwargs[key] is True and flag in argv
    overrides = json.loads(argv[argv.index("--hf-overrides") + 1])
    assert kwargs["hf_overrides"] == overrides == {"max_position_embeddings": 65536}
    short = engine_kwargs_of(dataclasses.replace(settings, extra_args=()), 1 << 20)
    assert "hf_overrides" not in short


def test_vllms_counters_on_rays_metrics_page_are_summed_over_replicas() -> None:
    page = "\n".join(
        [
            "# HELP ray_vllm_prefix_cache_hits_total Prefix cache hits, in tokens.",
            "# TYPE ray_vllm_prefix_cache_hits_total counter",
            'ray_vllm_prefix_cache_hits_total{ReplicaId="a",engine="0"} 320.0',
            'ray_vllm_prefix_cache_hits_total{ReplicaId="b",engine="0"} 64.0',
            'ray_vllm_num_requests_running{ReplicaId="a"} 2.0',
            'ray_vllm_request_num_preemptions_sum{ReplicaId="a"} 1.5',  # a histogram: left out
            'ray_vllm_request_num_preemptions_bucket{ReplicaId="a",le="1"} 3.0',
            'ray_serve_num_http_requests_total{route="/"} 9.0',  # not vLLM's
            "ray_vllm_garbled_total{} not-a-number",
        ]
    )
    assert ray_vllm_totals(page) == {
        "ray_vllm_prefix_cache_hits_total": 384.0,
        "ray_vllm_num_requests_running": 2.0,
    }


def test_a_serve_llm_app_without_its_virtualenv_or_with_a_bad_router_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    with pytest.raises(ValueError, match=r"builds \.venv-engine"):
        ServeLlmApp(str(tmp_path / "no-python"), "default", 2, {}, MODEL)
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(ValueError, match="router='kv'"):
        ServeLlmApp(str(python), "kv", 2, {}, MODEL)
    with pytest.raises(ValueError, match="replicas=0"):
        ServeLlmApp(str(python), "prefix", 0, {}, MODEL)
    app = ServeLlmApp(str(python), "prefix", 2, {"block_size": 32}, MODEL)
    argv = app.command()
    assert argv[argv.index("--router") + 1] == "prefix"
    assert json.loads(argv[argv.index("--engine-kwargs") + 1]) == {"block_size": 32}
    assert app.url.startswith("http://127.0.0.1:")
