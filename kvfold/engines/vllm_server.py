"""Runs a real vLLM OpenAI server as a subprocess, for kvfold to read (tests, benchmarks,
a user's trial). Standard library only: no Ray, no vLLM import (the engine lives in a
virtualenv of its own; `python` names that interpreter).

    VLLMServerSettings  what to run (kvfold.engines.vllm_settings; imported from here too)
    VLLMServer          start / wait_ready / complete / metrics_text / reset_prefix_cache / stop

Everything listens on 127.0.0.1. The KV-event sockets follow vLLM's own rule: with a
plain `tcp://127.0.0.1:P` the engine *connects* its PUB, so the reader (kvfold) must
bind a SUB on P before the engine starts; the replay ROUTER is bound by the engine.

    reader (kvfold)                          engine (vLLM)
    SUB  bind tcp://127.0.0.1:P   <-------   PUB    connect   (events_endpoint)
    DEALER connect 127.0.0.1:R    ------->   ROUTER bind      (replay_endpoint)

The reader must also keep polling its SUB from before the engine starts: libzmq hands a
newly connected PUB the SUB's subscription only when the SUB's owner thread next calls
into the socket, and the PUB drops every message until then (measured: a SUB left
untouched while the engine started received nothing, though the replay held the batch).

The server runs in a process group of its own (not a session: engines in sessions of
their own starved each other on a shared CPU), so stop() reaches the API server, the
EngineCore and its workers with one signal. The VLLMServer object owns that group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from kvfold.engines.vllm_settings import (
    BLOCK_SIZE_MULTIPLE,
    KV_DTYPE,
    KV_DTYPE_BYTES,
    LOOPBACK,
    VLLMServerSettings,
    free_loopback_port,
    kv_bytes_per_token,
)
from kvfold.errors import KVFoldError

LOG_TAIL_LINES = 40


class EngineStartError(KVFoldError, RuntimeError):
    """The engine exited or did not answer /health in time; the message holds its log tail."""


class EngineRequestError(KVFoldError, RuntimeError):
    """The engine refused or failed an HTTP request; `status` is its HTTP status (0: none)."""

    def __init__(self, path: str, status: int, detail: str) -> None:
        self.path = path
        self.status = status
        super().__init__(f"{path}: HTTP {status}: {detail}")


class VLLMServer:
    """One vLLM OpenAI server. Owns its process group from start() until stop()."""

    def __init__(self, settings: VLLMServerSettings) -> None:
        config_path = Path(settings.model_dir) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model_dir={settings.model_dir!r}: allowed: a directory holding config.json"
            )
        if not Path(settings.python).is_file():
            raise ValueError(
                f"python={settings.python!r}: allowed: the engine virtualenv's interpreter"
            )
        self.settings = settings
        self.kv_cache_memory_bytes = (
            settings.num_gpu_blocks
            * settings.block_size
            * kv_bytes_per_token(json.loads(config_path.read_text()))
        )
        self.port = settings.port
        self.log_path = settings.log_path
        self._proc: subprocess.Popen[bytes] | None = None

    # -- the process -------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The API server's pid, also its process group id; None before start()."""
        return None if self._proc is None else self._proc.pid

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        """The engine's argv (the port resolved by start())."""
        s = self.settings
        cmd = [
            s.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", s.model_dir, "--served-model-name", s.served_model_name,
            "--host", LOOPBACK, "--port", str(self.port),
            "--load-format", "dummy", "--enforce-eager",
            "--dtype", KV_DTYPE, "--seed", str(s.seed),
            "--enable-prefix-caching", "--block-size", str(s.block_size),
            "--kv-cache-memory-bytes", str(self.kv_cache_memory_bytes),
            "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if not s.serves_text:
            cmd.append("--skip-tokenizer-init")  # token ids in, token ids out
        if s.events_endpoint is not None:
            events: dict[str, Any] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": s.events_endpoint,
                "topic": s.topic,
            }
            if s.replay_endpoint is not None:
                events["replay_endpoint"] = s.replay_endpoint
            cmd += ["--kv-events-config", json.dumps(events)]
        return cmd + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        """This process's environment, without PYTHONHASHSEED (it would change vLLM's hash
        seed), no usage reports, offline, dev mode (for /reset_prefix_cache), then
        the thread settings and `extra_env`."""
        s = self.settings
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        env.update(
            VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
            VLLM_SERVER_DEV_MODE="1",
        )  # fmt: skip
        if s.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = s.omp_threads_bind
        if s.omp_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(s.omp_num_threads)
        env.update(s.extra_env)
        return env

    def start(self) -> None:
        """Spawn the server in a new process group, its output to `log_path`. Returns at
        once; wait_ready() waits for it to serve."""
        if self._proc is not None:
            raise RuntimeError(f"already started (pid {self._proc.pid})")
        if self.port == 0:
            self.port = free_loopback_port()
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix="kvfold-vllm-", suffix=".log")
            os.close(fd)
        group: dict[str, Any] = (
            {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        )
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                **group,
            )

    def wait_ready(self, timeout_s: float) -> float:
        """Poll GET /health until it answers 200. Returns the seconds waited. Raises
        EngineStartError (with the log tail) if the server exits or `timeout_s` passes;
        the server is left as it is (stop() it)."""
        if self._proc is None:
            raise RuntimeError("not started")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise EngineStartError(f"vLLM exited with {rc} before serving\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"vLLM did not serve /health within {timeout_s} s\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, num_lines)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it if still there after `timeout_s`, and
        wait until no process of the group is left. Idempotent; a no-op before start()."""
        if self._proc is not None:
            stop_process_group(self._proc, timeout_s)

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def __enter__(self) -> VLLMServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- HTTP --------------------------------------------------------------------------

    def complete(
        self, prompt_token_ids: Sequence[int], max_tokens: int, **extra: Any
    ) -> dict[str, Any]:
        """POST /v1/completions with token ids, greedy, `ignore_eos`, `return_token_ids`;
        `extra` adds or overrides body fields. The reply's
        `usage.prompt_tokens_details.cached_tokens` is the prefix hit in tokens."""
        if not prompt_token_ids or not all(isinstance(t, int) and t >= 0 for t in prompt_token_ids):
            raise ValueError(
                f"prompt_token_ids={list(prompt_token_ids)[:8]!r}...: allowed: a non-empty "
                "sequence of non-negative ints"
            )
        if max_tokens <= 0:
            raise ValueError(f"max_tokens={max_tokens}: allowed: > 0")
        body = {
            "model": self.settings.served_model_name,
            "prompt": list(prompt_token_ids),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }
        reply: dict[str, Any] = json.loads(self._http("POST", "/v1/completions", body))
        return reply

    def metrics_text(self) -> str:
        """The Prometheus page at GET /metrics."""
        return self._http("GET", "/metrics").decode()

    def reset_prefix_cache(self) -> None:
        """POST /reset_prefix_cache (dev mode). On an idle engine the AllBlocksCleared event
        is published at its next step, so send a request to see it."""
        self._http("POST", "/reset_prefix_cache")

    def _http(self, method: str, path: str, body: Any = None, timeout_s: float = 120.0) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"Content-Type": "application/json"}
        req = urllib.request.Request(self.base_url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw: bytes = r.read()
                return raw
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise EngineRequestError(path, e.code, detail) from e
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise EngineRequestError(path, 0, repr(e)) from e


def log_tail(path: str | None, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a subprocess's log file, to put in an error."""
    if not path or not os.path.exists(path):
        return "(no log)"
    lines = Path(path).read_text(errors="replace").splitlines()[-num_lines:]
    return f"last {len(lines)} lines of {path}:\n" + "\n".join(lines)


def stop_process_group(leader: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the process group `leader` leads, SIGKILL it if still there after
    `timeout_s`, and wait until no process of the group is left (the leader reaped)."""
    pgid = leader.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and _group_alive(pgid, leader):
        time.sleep(0.05)
    if _group_alive(pgid, leader):
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _group_alive(pgid, leader):
            time.sleep(0.05)
    leader.poll()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int, leader: subprocess.Popen[bytes]) -> bool:
    """True while a process of group `pgid` runs. The leader is reaped here; other
    members that died unreaped (zombies) do not count. Linux reads /proc; elsewhere a
    signal 0 to the group answers."""
    leader.poll()
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces or parentheses
        fields = text[text.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


__all__ = [
    "BLOCK_SIZE_MULTIPLE",
    "KV_DTYPE",
    "KV_DTYPE_BYTES",
    "LOOPBACK",
    "EngineRequestError",
    "EngineStartError",
    "VLLMServer",
    "VLLMServerSettings",
    "free_loopback_port",
    "kv_bytes_per_token",
    "stop_process_group",
]
