"""The pure core never imports Ray: only the shells do."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import kvfold

ROOT = pathlib.Path(kvfold.__file__).parent
SHELLS = ("cli", "metrics")
SHELL_ROOMS = ("cluster", "replay")  # launch; replay over a running kvfold
# Ray Serve's deployments and router (the rest of serving/ is its pure core)
SERVE_SHELLS = (
    "front_door",
    "door_requests",
    "door_http",
    "door_follow",
    "serve_llm_server",  # Ray Serve LLM's server and ingress, kvfold's way
    "request_router",
    "engine_replica",
)


def core_modules() -> list[str]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        name = ".".join(parts)
        if (
            path.name.endswith("_actor.py")
            or any(room in parts for room in SHELL_ROOMS)
            or (len(parts) > 2 and parts[-2] == "serving" and parts[-1] in SERVE_SHELLS)
            or path.name == "client.py"
            or parts[-1] in SHELLS
        ):
            continue
        out.append(name)
    return out


def test_core_modules_do_not_import_ray() -> None:
    modules = core_modules()
    assert "kvfold.worker.cache" in modules and "kvfold.topology" in modules
    # the cache's own modules are core; the rank actor's are its Ray shell
    assert {"kvfold.worker.cache_reads", "kvfold.worker.placement"} <= set(modules)
    assert not any(m.startswith("kvfold.worker.") and m.endswith("_actor") for m in modules)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "", f"ray imported by the core: {res.stdout}"
