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


# ---------------------------------------------------------------- the house's floors
# Data flows one way: rank -> node -> cluster -> readers. A module may import its own
# floor or the floors below it, never above; the rank's pure core (worker/, its Ray shell
# aside) stands on the foundation alone; no two modules import each other.
FLOORS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (0, ("kvfold.checks", "kvfold.errors", "kvfold.stats", "kvfold.topology", "kvfold.naming",
         "kvfold.ray_env", "kvfold.devices", "kvfold.blockindex.events",
         "kvfold.blockindex.journal")),
    (1, ("kvfold.worker",)),
    (2, ("kvfold.hosttier", "kvfold.view", "kvfold.codec", "kvfold.aggregator.fold",
         "kvfold.aggregator.freshness", "kvfold.aggregator.receiver",
         "kvfold.aggregator.node_state", "kvfold.aggregator.cluster_state",
         "kvfold.aggregator.counter_ledger", "kvfold.engines",
         "kvfold.blockindex")),
    (3, ("kvfold.admission", "kvfold.workload", "kvfold.metrics", "kvfold.display",
         "kvfold.live", "kvfold.kv_manager")),
    (4, ("kvfold.engines.engine_rank_actor", "kvfold.ray_actor", "kvfold.worker.rank_actor",
         "kvfold.worker.rank_calls_actor",
         "kvfold.worker.remote_host_actor", "kvfold.worker.report_actor",
         "kvfold.aggregator.node_actor",
         "kvfold.aggregator.cluster_actor", "kvfold.aggregator.client", "kvfold.cluster",
         "kvfold.blockindex.client",
         "kvfold.cli", "kvfold.aggregator")),
)  # fmt: skip


def floor_of(module: str) -> int:
    """The floor of the longest matching prefix (kvfold itself is the top)."""
    best, floor = -1, 4
    for f, prefixes in FLOORS:
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, floor = len(p), f
    return floor


def module_imports() -> dict[str, set[str]]:
    """Every kvfold module and the kvfold modules it imports (anywhere in its body)."""
    import ast

    out: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("kvfold")
            ):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("kvfold"))
        out[name] = deps - {name}
    return out


def test_no_import_runs_back_up_a_floor() -> None:
    graph = module_imports()
    assert "kvfold.worker.cache" in graph and "kvfold.codec.rank" in graph
    upward = sorted(
        f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
        for m, deps in graph.items()
        if m != "kvfold"  # the package's lazy exports name every room
        for d in deps
        if floor_of(d) > floor_of(m)
    )
    assert not upward, "\n".join(upward)


def test_the_rank_core_stands_on_the_foundation_alone() -> None:
    graph = module_imports()
    core = [m for m in graph if m.startswith("kvfold.worker") and floor_of(m) == 1]
    assert "kvfold.worker.cache" in core and "kvfold.worker.rank_actor" not in core
    for m in core:
        bad = [d for d in graph[m] if floor_of(d) > 0 and not d.startswith("kvfold.worker")]
        assert not bad, f"{m} imports {bad}"
    # and the rank's Ray shell reaches its node only through the wire and the host tier's
    # packing: nothing of the node's or the cluster's rooms, nothing of the workload
    rooms = ("kvfold.aggregator", "kvfold.workload", "kvfold.admission", "kvfold.cluster")
    for m in (m for m in graph if m.startswith("kvfold.worker")):
        bad = [d for d in graph[m] if d.startswith(rooms)]
        assert not bad, f"{m} imports {bad}"


def test_no_two_modules_import_each_other() -> None:
    graph = module_imports()
    pairs = sorted(
        (a, b)
        for a, deps in graph.items()
        for b in deps
        if a < b
        and a in graph.get(b, set())
        and not b.startswith(a + ".")
        and not a.startswith(b + ".")
    )
    assert not pairs, pairs
