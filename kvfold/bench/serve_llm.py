"""Ray Serve LLM's application as a subprocess: the anchor arms `serve_llm_default` and
`serve_llm_prefix` of `kvfold bench-serve`, and `serve_llm_kvfold`, the same application
with kvfold inside it (kvfold.serving.serve_llm). Standard library only. The application
runs in the engine virtualenv, where Ray Serve LLM lives beside vLLM (`make test` builds
it), with a Ray instance of its own (kvfold.bench.serve_llm_app), because Ray Serve LLM
starts its engines inside its replicas and needs Ray and vLLM in one environment.

    ServeLlmApp(python, router, replicas, engine_kwargs, model_dir)
      .command()        its argv, printed with the results
      start / wait_ready / url / counters / settle / stop
    engine_kwargs_of(settings, kv_cache_memory_bytes)   the same engine as bench-serve's own

Its engines are not bench-serve's: they are the replicas' own, started with the same vLLM
arguments, fresh (empty caches) for each arm. Their counters are vLLM's own, reported
through Ray's metrics (`log_engine_metrics`) and read from Ray's metrics agent on loopback:
`ray_vllm_prefix_cache_hits_total` and `ray_vllm_num_preemptions_total`, summed over the
replicas. A counter Ray has never seen incremented is absent: it reads 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from kvfold.bench.bench_serve import EngineCounters, engine_counters
from kvfold.engines.vllm_server import EngineStartError, log_tail, stop_process_group
from kvfold.engines.vllm_settings import LOOPBACK, free_loopback_port

ROUTERS = ("default", "prefix", "kvfold")
REPO = Path(__file__).resolve().parents[2]


def engine_kwargs_of(settings: Any, kv_cache_memory_bytes: int) -> dict[str, Any]:
    """vLLM's engine arguments for a Serve LLM replica, equal to what bench-serve's own
    engines are started with (kvfold.engines.vllm_server.VLLMServer.command)."""
    from kvfold.engines.vllm_settings import KV_DTYPE

    kwargs: dict[str, Any] = {
        "load_format": "dummy", "enforce_eager": True, "dtype": KV_DTYPE,
        "seed": settings.seed, "enable_prefix_caching": True,
        "block_size": settings.block_size, "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "max_model_len": settings.max_model_len, "max_num_seqs": settings.max_num_seqs,
        "enable_prompt_tokens_details": True,
    }  # fmt: skip
    extra = list(settings.extra_args)
    if "--hf-overrides" in extra:
        kwargs["hf_overrides"] = json.loads(extra[extra.index("--hf-overrides") + 1])
    return kwargs


class ServeLlmApp:
    def __init__(
        self,
        python: str,
        router: str,
        replicas: int,
        engine_kwargs: Mapping[str, Any],
        model_dir: str,
    ) -> None:
        if router not in ROUTERS:
            raise ValueError(f"router={router!r}: allowed: one of {', '.join(ROUTERS)}")
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: allowed: >= 1")
        if not Path(python).is_file():
            raise ValueError(
                f"python={python!r}: allowed: the engine virtualenv's interpreter (make "
                "test builds .venv-engine with Ray Serve LLM)"
            )
        self.python = python
        self.router = router
        self.replicas = replicas
        self.engine_kwargs = dict(engine_kwargs)
        self.model_dir = model_dir
        self.port = free_loopback_port()
        self.metrics_port = free_loopback_port()
        self.log_path = ""
        self.ready_s: float | None = None
        self.numbers: list[str] = []  # with kvfold: the replicas' numbers pages
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [
            self.python, "-m", "kvfold.bench.serve_llm_app", "--model-dir", self.model_dir,
            "--replicas", str(self.replicas), "--router", self.router,
            "--port", str(self.port), "--metrics-port", str(self.metrics_port),
            "--engine-kwargs", json.dumps(self.engine_kwargs, sort_keys=True),
        ]  # fmt: skip

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"already started (pid {self._proc.pid})")
        fd, self.log_path = tempfile.mkstemp(prefix="kvfold-serve-llm-", suffix=".log")
        os.close(fd)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_TMPDIR"):
            env.pop(name, None)  # a Ray instance of its own, with a token of its own
        self._proc = subprocess.Popen(
            self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, env=env, process_group=0,
        )  # fmt: skip
        threading.Thread(target=self._copy_log, args=(self._proc.stdout,), daemon=True).start()

    def _copy_log(self, out: IO[bytes] | None) -> None:
        if out is None:
            return
        with open(self.log_path, "ab") as log:
            for line in out:
                log.write(line)
                log.flush()
                if line.startswith(b"READY "):
                    ready = json.loads(line[6:])
                    self.ready_s = float(ready["ready_s"])
                    self.numbers = list(ready.get("numbers") or [])
                    self._ready.set()

    def wait_ready(self, timeout_s: float = 900.0) -> float:
        """Until the application answers /v1/models (its READY line)."""
        if self._proc is None:
            raise RuntimeError("not started")
        t0 = time.monotonic()
        while not self._ready.wait(1.0):
            if self._proc.poll() is not None:
                raise EngineStartError(
                    f"Serve LLM app exited with {self._proc.returncode}\n{self.log_tail()}"
                )
            if time.monotonic() - t0 > timeout_s:
                raise EngineStartError(
                    f"Serve LLM app not ready within {timeout_s} s\n{self.log_tail()}"
                )
        return time.monotonic() - t0

    def metrics_text(self) -> str:
        url = f"http://{LOOPBACK}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            return str(r.read().decode())

    def counters(self) -> EngineCounters:
        """The replicas' engines' own counters, summed (Ray's metrics page; with kvfold, the
        replicas' numbers pages, vLLM's own series)."""
        if self.numbers:
            return engine_counters(self.numbers)
        m = ray_vllm_totals(self.metrics_text())
        return EngineCounters(
            cached_tokens=int(m.get("ray_vllm_prefix_cache_hits_total", 0)),
            preemptions=int(m.get("ray_vllm_num_preemptions_total", 0)),
            running=int(m.get("ray_vllm_num_requests_running", 0)),
            waiting=int(m.get("ray_vllm_num_requests_waiting", 0)),
        )

    def start_empty(self) -> None:
        """A new application's engines are empty: wait until they are idle."""
        self.settle()

    def settle(self, timeout_s: float = 120.0) -> EngineCounters:
        """Wait until the engines are idle and their counters have stopped moving through
        Ray's reports (once a second); the counters then."""
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            now = self.counters()
            idle = now.running == 0 and now.waiting == 0
            if idle and now == last:
                return now
            last = now
            if time.monotonic() > deadline:
                raise TimeoutError(f"Serve LLM's engines still moving after {timeout_s} s")
            time.sleep(3.0)

    def log_tail(self, num_lines: int = 40) -> str:
        return log_tail(self.log_path, num_lines)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Close its stdin (it stops Serve and Ray), then end its process group."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            print(f"Serve LLM app did not stop in {timeout_s} s; ending it", file=sys.stderr)
        stop_process_group(proc, 10.0)

    def __enter__(self) -> ServeLlmApp:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ray_vllm_totals(page: str) -> dict[str, float]:
    """vLLM's series on Ray's metrics page (`ray_vllm_*`, no histogram parts), each summed
    over its labels (replicas, engines)."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if not line.startswith("ray_vllm_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.endswith(("_bucket", "_sum", "_count")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return out


__all__ = ["ROUTERS", "ServeLlmApp", "engine_kwargs_of", "ray_vllm_totals"]
