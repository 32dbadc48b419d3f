"""Hosts on one machine: each a Linux network namespace of its own, with an address from
the benchmarking range (198.18.0.0/15) on a bridge that lives in a namespace of its own
too, so nothing of the machine's own network changes and no packet leaves the machine.

    Hosts(n)                  n hosts, 198.18.S.10 + i, one subnet S per harness (its pid)
      .address(i)             host i's address
      .run(i, argv, ...)      a process in host i's namespace (its own session: it and what
                              it starts end together)
      .cut(i) / .heal(i)      host i's link to the bridge down / up
      .close()                every process it started ended (by process group), every
                              namespace deleted; also on a failure half way through
    RayHost                   `ray start --block` in a host: head or worker, token auth on,
                              a temp dir of its own; .kill() ends its whole process group
    namespaces_allowed()      None, or the one line that says why this machine cannot

Needs root (CAP_NET_ADMIN) and `ip` (iproute2). No `ray stop` anywhere: every Ray process
this starts is ended by its process group id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RAY_PORT = 6379  # the head's GCS port, on its host's address


def namespaces_allowed() -> str | None:
    """None where this process can make network namespaces, else why not (one line)."""
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on this machine"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"kvfprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"this machine forbids network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


class Hosts:
    def __init__(self, n: int, subnet: int | None = None) -> None:
        if not 1 <= n <= 200:
            raise ValueError(f"n={n}: allowed: 1..200 hosts")
        tag = os.getpid() % 100000
        self.subnet = subnet if subnet is not None else tag % 250 + 1  # 198.18.S.0/24
        self.prefix = f"kvf{tag}"
        self.switch = f"{self.prefix}sw"
        self.names = [f"{self.prefix}h{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.temp_dirs: list[Path] = []  # removed on close
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.names):
            _ip("netns", "add", ns)
            self._made.append(ns)
            host_end, switch_end = f"{self.prefix}a{i}", f"{self.prefix}b{i}"
            _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
            _ip("link", "set", host_end, "netns", ns)
            _ip("link", "set", switch_end, "netns", self.switch)
            _ip("-n", ns, "link", "set", host_end, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "set", switch_end, "master", "br0")
            _ip("-n", self.switch, "link", "set", switch_end, "up")

    def address(self, i: int) -> str:
        return f"198.18.{self.subnet}.{10 + i}"

    def run(
        self,
        i: int,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """`argv` inside host i's namespace, in a session of its own; its output to `log`
        (or discarded)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.names[i], *argv], env=dict(env or os.environ),
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def cut(self, i: int) -> None:
        """Host i's link down: nothing reaches it or leaves it but its own loopback."""
        _ip("-n", self.switch, "link", "set", f"{self.prefix}b{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", f"{self.prefix}b{i}", "up")

    def close(self) -> None:
        end_groups(self.procs)
        self.procs.clear()
        for ns in reversed(self._made):  # deleting a namespace deletes its veth ends
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._made.clear()
        for d in self.temp_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.temp_dirs.clear()

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def end_groups(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM to every process's group at once, then SIGKILL to what is left of each after
    `grace_s` in all (Ray's `ray start --block` stops its node on SIGTERM)."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        _signal_group(proc.pid, signal.SIGKILL)  # what it started, even after it exited
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def end_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM to the process's group, SIGKILL to what is left after `grace_s`."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # what it started, even after it exited
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


@dataclass
class RayHost:
    """A Ray node in host `i`: the head when `head` is None, else a worker joining it."""

    hosts: Hosts
    i: int
    token: str
    head: str | None = None  # the head's HOST:PORT
    num_cpus: int = 2
    num_gpus: int = 0
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    temp_dir: Path | None = None
    log: Path | None = None

    def ray_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(
            RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0",
            **self.env,
        )  # fmt: skip
        return env

    def start(self, ray_bin: str) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix=f"kvh{self.i}", dir="/tmp"))
        self.hosts.temp_dirs.append(self.temp_dir)
        self.log = self.temp_dir / "ray_start.log"
        address = self.hosts.address(self.i)
        argv = [ray_bin, "start", "--block", "--node-ip-address", address,
                "--temp-dir", str(self.temp_dir), "--num-cpus", str(self.num_cpus),
                "--num-gpus", str(self.num_gpus), "--disable-usage-stats"]  # fmt: skip
        if self.head is None:
            argv += ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"]
        else:
            argv += ["--address", self.head]
        self.proc = self.hosts.run(self.i, argv, env=self.ray_env(), log=self.log)

    def kill(self) -> None:
        """The whole Ray node at once (raylet, its workers, the head's GCS): SIGKILL."""
        if self.proc is not None:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def log_tail(self, n: int = 30) -> str:
        if self.log is None or not self.log.exists():
            return ""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def wait_for(cond: object, timeout_s: float, what: str, interval_s: float = 0.2) -> object:
    """Poll `cond()` until truthy; fail naming `what` and its last value."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        last = cond()  # type: ignore[operator]
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")


__all__ = [
    "RAY_PORT",
    "Hosts",
    "RayHost",
    "end_group",
    "end_groups",
    "namespaces_allowed",
    "wait_for",
]
