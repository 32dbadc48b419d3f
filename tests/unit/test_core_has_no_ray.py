"""The pure core never imports Ray: only the shells do."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import kvfold

ROOT = pathlib.Path(kvfold.__file__).parent
SHELLS = ("cli", "metrics")


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
            or "cluster" in parts
            or path.name == "client.py"
            or parts[-1] in SHELLS
        ):
            continue
        out.append(name)
    return out


def test_core_modules_do_not_import_ray() -> None:
    modules = core_modules()
    assert "kvfold.worker.cache" in modules and "kvfold.topology" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(bad))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "", f"ray imported by the core: {res.stdout}"
