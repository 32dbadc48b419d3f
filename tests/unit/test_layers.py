"""The rooms of kvfold, as the README draws them from the ground up: every import between
rooms points down (or stays on its line), so there are no circles between rooms; every
room is drawn exactly once; and within a room no two modules import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvfold

PACKAGE = Path(kvfold.__file__).parent
README = PACKAGE.parent / "README.md"


def room_of(module: str) -> str:
    """`kvfold.worker.cache` -> `worker/`; `kvfold.stats` -> `stats.py`."""
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    return f"{parts[1]}/" if (PACKAGE / parts[1]).is_dir() else f"{parts[1]}.py"


def drawn_lines() -> dict[str, int]:
    """Each room's line in the README's list."""
    text = README.read_text()
    section = text.split("## Layout: rooms from the ground up", 1)[1].split("\n## ", 1)[0]
    line_of: dict[str, int] = {}
    for line in section.splitlines():
        m = re.match(r"(\d+)\. (.*?) -- ", line)
        if m is None:
            continue
        for name in re.findall(r"`([\w_]+(?:/|\.py))`", m.group(2)):
            assert name not in line_of, f"{name} is drawn twice"
            line_of[name] = int(m.group(1))
    return line_of


def imports() -> list[tuple[str, str, str]]:
    """(importing room, imported room, where) for every import of kvfold between rooms."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = room_of(module)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "kvfold" or name.startswith("kvfold."):
                    there = room_of(name)
                    if there != here:
                        out.append(
                            (here, there, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
                        )
    return out


def test_every_room_is_drawn_once() -> None:
    line_of = drawn_lines()
    rooms = {room_of("kvfold." + p.stem) for p in PACKAGE.glob("*.py")} | {
        f"{d.name}/" for d in PACKAGE.iterdir() if d.is_dir() and (d / "__init__.py").exists()
    }
    rooms = {"__init__.py" if r == "__init__.py" else r for r in rooms}
    assert rooms == set(line_of), (
        f"in the code, not drawn: {sorted(rooms - set(line_of))}; "
        f"drawn, not in the code: {sorted(set(line_of) - rooms)}"
    )


def test_no_import_points_up() -> None:
    line_of = drawn_lines()
    up = [
        f"{where}: {here} (line {line_of[here]}) imports {there} (line {line_of[there]})"
        for here, there, where in imports()
        if line_of[there] > line_of[here]
    ]
    assert not up, "imports pointing up:\n" + "\n".join(up)


def test_no_two_modules_import_each_other() -> None:
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
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
