"""Process settings for Ray on one machine, applied before Ray is first imported.

An embedded cluster (`start_local_cluster`, `kvfold demo`) is closed to the network
twice over (docs/security.md): every process binds and advertises 127.0.0.1 only,
and Ray's token authentication is on, with a random token; a process keeps one
token for every cluster it embeds. Ray 2.60 reads the loopback setting and the auth
mode when `ray` is imported: where it was imported before these were set,
kvfold.cluster.local makes it read them again. The token is written, readable by its owner only, to
`~/.kvfold/auth/<host>_<port>.token` (`KVFOLD_HOME` moves it), where `kvfold status`,
`top` and `down` given that `--address` find it.

No Ray import here: this must run first.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path


def is_local_address(address: str | None) -> bool:
    """True for no address (an embedded or auto-detected local cluster) or a loopback one."""
    if not address or address == "auto":
        return True
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("localhost", "[::1]", "::1")


def token_file(address: str) -> Path:
    """Where an embedded cluster at `address` keeps its auth token."""
    home = Path(os.environ.get("KVFOLD_HOME") or Path.home() / ".kvfold")
    name = address.removeprefix("ray://").replace(":", "_").replace("/", "_")
    return home / "auth" / f"{name}.token"


def use_token(token: str) -> None:
    """Turn Ray's token authentication on for this process (before `import ray`)."""
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token


def apply_local_defaults(address: str | None = None) -> None:
    """Set, unless already set: no usage stats; and for a local (loopback) cluster:
    127.0.0.1-only binding, a short tmpdir, and the cluster's auth token when kvfold
    started it. A remote `address` keeps Ray's own networking and auth settings."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not is_local_address(address):
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvf", dir="/tmp")
    if address and address != "auto" and not os.environ.get("RAY_AUTH_TOKEN"):
        path = token_file(address)
        if path.is_file():
            use_token(path.read_text(encoding="utf-8").strip())


def secure_embedded_cluster() -> None:
    """Before an embedded cluster starts: loopback binding, and token auth with a random
    token unless this process already has one. Where Ray was imported before, the
    cluster (kvfold.cluster.local) makes that Ray see these settings too."""
    apply_local_defaults()
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # an embedded cluster is loopback only
    if os.environ.get("RAY_AUTH_MODE") == "token" and os.environ.get("RAY_AUTH_TOKEN"):
        return
    use_token(secrets.token_urlsafe(32))


def save_token(address: str) -> Path | None:
    """Write this process's token for the cluster at `address` (owner-only); None if
    token auth is off."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    if os.environ.get("RAY_AUTH_MODE") != "token" or not token:
        return None
    path = token_file(address)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")
    return path
