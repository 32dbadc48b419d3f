"""Process settings for Ray on one machine, applied before Ray is first imported.

On an embedded (single-machine) cluster these make Ray bind and advertise
127.0.0.1 only, skip usage reporting, and keep its socket paths short.
No Ray import here: this must run first.
"""

from __future__ import annotations

import os
import tempfile


def is_local_address(address: str | None) -> bool:
    """True for no address (an embedded or auto-detected local cluster) or a loopback one."""
    if not address or address == "auto":
        return True
    host = address.removeprefix("ray://").rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("localhost", "[::1]", "::1")


def apply_local_defaults(address: str | None = None) -> None:
    """Set, unless already set: no usage stats; and for a local (loopback) cluster:
    127.0.0.1-only binding, no auth, a short tmpdir. A remote `address` keeps
    Ray's own networking and auth settings."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not is_local_address(address):
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if "RAY_TMPDIR" not in os.environ:
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="kvf", dir="/tmp")
