"""vllm-router (PyPI `vllm-router`, the vLLM project's Rust router) as a subprocess in front
of N engines: an anchor arm of `kvfold bench-serve`. Standard library only; the router lives
in a virtualenv of its own (`make test` builds `.venv-router`).

    VllmRouter(binary, policy, worker_urls, kv_event_sources=...)
      .command()       its argv, printed with the results so that anyone can argue with it
      start / wait_ready / url / metrics_text / stop

Everything it opens is on 127.0.0.1: its HTTP port and its own Prometheus port (its
`/metrics` on the main port is proxied to a worker). kv_aware reads the engines' KV events
from ZMQ endpoints it connects to (kvfold.bench.event_relay binds them).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from kvfold.engines.vllm_server import EngineStartError, log_tail, stop_process_group
from kvfold.engines.vllm_settings import LOOPBACK, free_loopback_port

POLICIES = ("power_of_two", "cache_aware", "kv_aware", "round_robin")


class VllmRouter:
    def __init__(
        self,
        binary: str,
        policy: str,
        worker_urls: Sequence[str],
        *,
        kv_event_sources: Sequence[str] = (),
        kv_event_replay_sources: Sequence[str] = (),
        block_size: int = 32,
        model: str = "tiny-llama",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: allowed: one of {', '.join(POLICIES)}")
        if not worker_urls:
            raise ValueError("worker_urls=(): allowed: one engine URL or more")
        if not Path(binary).is_file():
            raise ValueError(
                f"binary={binary!r}: allowed: the vllm-router executable (make test builds "
                ".venv-router)"
            )
        if policy == "kv_aware" and len(kv_event_sources) != len(worker_urls):
            raise ValueError(
                f"kv_event_sources: {len(kv_event_sources)} for {len(worker_urls)} engines: "
                "allowed: one tcp://127.0.0.1:PORT per engine, in the same order"
            )
        self.binary = binary
        self.policy = policy
        self.worker_urls = list(worker_urls)
        self.kv_event_sources = list(kv_event_sources)
        self.kv_event_replay_sources = list(kv_event_replay_sources)
        self.block_size = block_size
        self.model = model
        self.port = free_loopback_port()
        self.prometheus_port = free_loopback_port()
        self.log_path = ""
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            self.binary, "--host", LOOPBACK, "--port", str(self.port),
            "--worker-urls", *self.worker_urls, "--policy", self.policy,
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(self.prometheus_port),
            "--worker-startup-check-interval", "1", "--log-level", "warning",
            "--request-timeout-secs", "600",
        ]  # fmt: skip
        if self.policy == "kv_aware":
            for url, src in zip(self.worker_urls, self.kv_event_sources, strict=True):
                cmd += ["--kv-event-source", f"{url}={src}"]
            for url, src in zip(self.worker_urls, self.kv_event_replay_sources, strict=False):
                cmd += ["--kv-event-replay-source", f"{url}={src}"]
            cmd += ["--kv-event-block-size", str(self.block_size), "--kv-event-model", self.model]
        return cmd

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"already started (pid {self._proc.pid})")
        fd, self.log_path = tempfile.mkstemp(prefix="kvfold-vllm-router-", suffix=".log")
        os.close(fd)
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                process_group=0,
            )

    def wait_ready(self, timeout_s: float = 60.0) -> float:
        """Poll its /health until 200 (it answers once its workers do)."""
        if self._proc is None:
            raise RuntimeError("not started")
        t0 = time.monotonic()
        while True:
            if self._proc.poll() is not None:
                raise EngineStartError(f"vllm-router exited with {self._proc.returncode}\n"
                                       f"{self.log_tail()}")  # fmt: skip
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise EngineStartError(
                    f"vllm-router did not serve /health within {timeout_s} s\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def metrics_text(self) -> str:
        """Its own Prometheus page (its Prometheus port, not the proxied /metrics)."""
        url = f"http://{LOOPBACK}:{self.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())

    def log_tail(self, num_lines: int = 30) -> str:
        return log_tail(self.log_path, num_lines)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is not None:
            stop_process_group(self._proc, timeout_s)
            self._proc = None

    def __enter__(self) -> VllmRouter:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["POLICIES", "VllmRouter"]
