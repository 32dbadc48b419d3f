"""Every example runs as a newcomer would run it (a subprocess, its embedded default,
small sizes), exits 0, and prints what it claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES = {
    "seed_facade.py": ([], ["node 2 host: 8/32 pages used", "trigger prefill: True", "done"]),
    "paged_attention.py": ([], []),
    "launch_on_cluster.py": (
        ["--namespace", "kvfold-ex-launch"],
        ["kvfold is up", "the cluster view", "GPU blocks used", "done"],
    ),
    "query_aggregator.py": (
        ["--namespace", "kvfold-ex-query"],
        ["view version", "node 0 (fresh)", "rank 0 (fresh", "next version", "block index:", "done"],
    ),
    "serve_front_door.py": (
        ["--engines", "1"],  # one engine shows the cache; each more costs the suite ~10 s
        [
            "vLLM engines serving at",
            "front door at",
            "front door: engine",
            "done",
        ],
    ),
    "scheduler_loop.py": (
        ["--namespace", "kvfold-ex-sched", "--requests", "12"],
        ["ADMIT   rank", "completed 12 of 12", "restarted 0, failed 0", "decisions:"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs_and_prints_what_it_claims(name: str) -> None:
    args, expected = CASES[name]
    res = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout
    why = f"{name} exited {res.returncode}\n{out[-3000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, why
    for line in expected:
        assert line in out, f"{name} did not print {line!r}:\n{out[-3000:]}"


# run elsewhere in `make test`, in the virtualenv they need
ELSEWHERE = {"serve_llm_kvfold.py": "tests/serve_llm, in the engine virtualenv"}


def test_every_example_is_run_here() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(CASES) | set(ELSEWHERE)
    ran = (EXAMPLES.parent / "tests" / "serve_llm" / "test_serve_llm_kvfold.py").read_text()
    assert "serve_llm_kvfold.py" in ran


README = EXAMPLES.parent / "README.md"


def readme_snippets() -> list[str]:
    """The README's Python blocks, in order."""
    text = README.read_text()
    return [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]


@pytest.mark.parametrize("i", range(len(readme_snippets())))
def test_readme_snippet_runs_as_written(i: int) -> None:
    """What the README shows a newcomer runs as is, each block in a fresh interpreter."""
    code = readme_snippets()[i]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"README block {i} failed:\n{code}\n{res.stderr[-3000:]}"
