"""Hosts as Linux network namespaces on one bridge, for multi-host integration tests.

A test that needs "machines" (a database server on one, a scheduler on another, workers and clients on more)
gets them here without VMs or containers: each host is a network namespace with its own loopback and an `eth0`
on a private 10.231.0.0/24 LAN, joined by a Linux bridge that lives in a "switch" namespace of its own. Nothing
is added to the root namespace, so the machine's own network is never touched, and a server bound to 127.0.0.1
on one host is out of reach of the others, as on real machines.

    require_netns()                       # skip (or fail, with GAT_REQUIRE_NETNS=1) without CAP_NET_ADMIN
    with network(["db", "worker"]) as net:
        db, worker = net.hosts["db"], net.hosts["worker"]
        server = db.popen(["postgres", ...])  # runs inside the db host
        worker.run(f"psql -h {db.address} ...")
        db.cut()                          # cable cut: the others get no answer at all
        db.restore()

On exit every process in the network's namespaces is stopped (SIGTERM, then SIGKILL), the namespaces are
deleted, and whatever is left (a namespace, an interface, a process) raises AssertionError.

Namespaces are named `gat-<pid>-<n>-<host>` and `gat-<pid>-<n>-switch`; those whose PID is no longer alive
were left by a crashed run, and the next `network()` removes them first.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import psutil
import pytest

SUBNET = "10.231.0"
PREFIX_LENGTH = 24
FIRST_HOST_OCTET = 10
RUN_TIMEOUT_S = 120.0
IP_TIMEOUT_S = 30.0
# A stopped process gets this long after SIGTERM before SIGKILL, and as long again to be gone.
GRACE_S = 5.0
NAMESPACE_PATTERN = re.compile(r"^gat-(\d+)-")
HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")
BRIDGE = "br0"
NETNS_DIR = "/var/run/netns"  # where `ip netns add` puts a namespace's name

_sequence = 0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip <args>`, bounded, its output kept: a failure says what `ip` said."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    """Names from `ip netns list` ("name" or "name (id: N)")."""
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _namespace_pids(namespace: str) -> list[int]:
    """`ip netns pids`: every process whose network namespace is this one."""
    result = _ip("netns", "pids", namespace, check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def _root_interfaces() -> list[str]:
    """Interface names in this process's (the root) namespace, from `ip -o link` ("3: name@peer: <...>")."""
    result = _ip("-o", "link", check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in result.stdout.splitlines() if ":" in line]


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie: a zombie has exited and holds no namespace, only a PID its parent has to reap."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _namespace_inode(namespace: str) -> int | None:
    """The namespace's identity, which stays valid after `ip netns delete` while a process still holds it."""
    with contextlib.suppress(OSError):
        return os.stat(os.path.join(NETNS_DIR, namespace)).st_ino
    return None


def _processes(inodes: set[int]) -> list[psutil.Process]:
    """The processes in these network namespaces, as psutil objects, so that a signal never reaches a reused PID.

    By inode from /proc/<pid>/ns/net rather than `ip netns pids <name>`: that also finds a process in a namespace
    whose name is already gone (one that was entering it, with `ip netns exec`, while the namespace was deleted).
    """
    found: list[psutil.Process] = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError, ValueError, psutil.NoSuchProcess):
            if int(os.readlink(f"/proc/{pid}/ns/net").removeprefix("net:[").rstrip("]")) in inodes:
                found.append(psutil.Process(pid))
    return found


def _wait_gone(processes: list[psutil.Process], popens: list[subprocess.Popen], timeout: float) -> list[psutil.Process]:
    """Wait (bounded) until none is alive, reaping our own children through their Popen so it keeps the exit code."""
    deadline = time.monotonic() + timeout
    while True:
        for popen in popens:
            popen.poll()
        left = [process for process in processes if _alive(process)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def _signal(processes: list[psutil.Process], signum: int) -> None:
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.send_signal(signum)


def _stop(inodes: set[int], popens: list[subprocess.Popen], grace: float = GRACE_S) -> list[psutil.Process]:
    """SIGTERM every process in the namespaces and every running popen, SIGKILL what is left after `grace`.

    The popens count whatever namespace they are in: right after Popen returns, `ip netns exec` may not have
    entered its namespace yet. A few rounds, since a process may start another while it stops; each is bounded.
    Returns every process seen.
    """
    seen: list[psutil.Process] = []
    for _ in range(3):
        processes = {process.pid: process for process in _processes(inodes) if process.pid != os.getpid()}
        for popen in popens:
            if popen.poll() is None and popen.pid not in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    processes[popen.pid] = psutil.Process(popen.pid)
        if not processes:
            break
        seen += processes.values()
        _signal(list(processes.values()), signal.SIGTERM)
        left = _wait_gone(list(processes.values()), popens, grace)
        _signal(left, signal.SIGKILL)
        _wait_gone(left, popens, grace)
    _wait_gone([], popens, 0)
    return seen


def _remove_stale() -> None:
    """Delete `gat-<pid>-...` namespaces whose PID is gone (a crashed run), after killing what still runs in them.

    Deleting the namespaces removes their veths too. Those of a live PID (a concurrent run) are left alone.
    """
    stale = [name for name in _namespaces()
             if (match := NAMESPACE_PATTERN.match(name)) and not psutil.pid_exists(int(match.group(1)))]
    if not stale:
        return
    inodes = {inode for name in stale if (inode := _namespace_inode(name)) is not None}
    _signal(_processes(inodes), signal.SIGKILL)
    _wait_gone(_processes(inodes), [], GRACE_S)
    for name in stale:
        _ip("netns", "delete", name, check=False)


@functools.cache
def netns_unavailable() -> str | None:
    """None when this process can build a network here, else a one-line reason (for pytest.skip).

    Proven, not guessed from the UID: a throwaway namespace is created with a bridge and a veth pair in it
    (so a missing kernel module shows too), then deleted. Cached: the answer does not change within a run.
    """
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"gat-{os.getpid()}-probe"
    steps = [("netns", "add", probe),
             ("-n", probe, "link", "add", "probe-br", "type", "bridge"),
             ("-n", probe, "link", "add", "probe-a", "type", "veth", "peer", "name", "probe-b")]
    try:
        for step in steps:
            result = _ip(*step, check=False)
            if result.returncode != 0:
                what = ("no CAP_NET_ADMIN (or CAP_SYS_ADMIN)" if step[0] == "netns"
                        else "no CAP_NET_ADMIN, or no bridge or veth in the kernel")
                stderr = " ".join(result.stderr.split())
                return f"{what}: `ip {' '.join(step)}` failed: {stderr}"
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`ip` could not run: {error}"
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            _ip("netns", "delete", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the test without network namespaces; fail it instead where GAT_REQUIRE_NETNS=1 (CI: they must run)."""
    reason = netns_unavailable()
    if reason is None:
        return
    if os.environ.get("GAT_REQUIRE_NETNS") == "1":
        pytest.fail(f"GAT_REQUIRE_NETNS=1 but {reason}")
    pytest.skip(reason)


@dataclass
class Host:
    """One "machine": a network namespace with `lo` and `eth0` (`address`/24), cabled to the switch by `peer`."""

    name: str
    namespace: str
    address: str
    switch: str
    peer: str
    popens: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, command: list[str]) -> list[str]:
        """The command line that runs `command` in this host (root's filesystem, this host's network)."""
        return ["ip", "netns", "exec", self.namespace, *command]

    def _command(self, command: list[str] | str) -> list[str]:
        return self.argv(["bash", "-c", command] if isinstance(command, str) else command)

    def run(self, command: list[str] | str, **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run in this host; a str runs through `bash -c`. Output captured as text, 120 s limit."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", RUN_TIMEOUT_S)
        return subprocess.run(self._command(command), **kwargs)

    def popen(self, command: list[str] | str, **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen in this host; stopped and reaped when the network closes, if the test has not."""
        process = subprocess.Popen(self._command(command), **kwargs)
        self.popens.append(process)
        return process

    def pids(self) -> list[int]:
        """Every process running in this host (`ip netns pids`)."""
        return _namespace_pids(self.namespace)

    def cut(self) -> None:
        """Unplug the cable at the switch: from then on the others get no answer from this host, not even a refusal."""
        _ip("-n", self.switch, "link", "set", self.peer, "down")

    def restore(self) -> None:
        """Plug the cable back in (the bridge has STP off, so the port forwards at once)."""
        _ip("-n", self.switch, "link", "set", self.peer, "up")


@dataclass
class Network:
    """Hosts on one bridge. Build it with `network()`, which also takes it down."""

    prefix: str
    hosts: dict[str, Host]
    inodes: set[int] = field(default_factory=set, repr=False)

    @property
    def switch(self) -> str:
        return f"{self.prefix}switch"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(host.namespace for host in self.hosts.values())]

    def _add_namespace(self, namespace: str) -> None:
        _ip("netns", "add", namespace)
        inode = _namespace_inode(namespace)
        if inode is None:
            raise RuntimeError(f"`ip netns add {namespace}` made no {NETNS_DIR}/{namespace}")
        self.inodes.add(inode)

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0")
        _ip("-n", self.switch, "link", "set", BRIDGE, "up")
        for host in self.hosts.values():
            self._add_namespace(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            # Made inside the host, its peer sent straight to the switch: no end of it is ever in the root namespace.
            _ip("-n", host.namespace, "link", "add", "eth0", "type", "veth", "peer", "name", host.peer,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", host.peer, "master", BRIDGE)
            _ip("-n", self.switch, "link", "set", host.peer, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LENGTH}", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")

    def _close(self) -> None:
        """Stop every process, delete the namespaces, then check that nothing is left (removing it anyway)."""
        popens = [popen for host in self.hosts.values() for popen in host.popens]
        seen = _stop(self.inodes, popens)
        for namespace in self.namespaces:
            if namespace in _namespaces():
                _ip("netns", "delete", namespace, check=False)
        left: list[str] = []
        namespaces = [name for name in _namespaces() if name.startswith(self.prefix)]
        if namespaces:
            seen += _stop({inode for name in namespaces if (inode := _namespace_inode(name)) is not None}, popens)
            for name in namespaces:
                _ip("netns", "delete", name, check=False)
            left += [f"namespace {name}" for name in namespaces]
        peers = {host.peer for host in self.hosts.values()}
        interfaces = [name for name in _root_interfaces() if name in peers]
        for name in interfaces:
            _ip("link", "delete", name, check=False)
        left += [f"interface {name} in the root namespace" for name in interfaces]
        processes = list({process.pid: process for process in [*seen, *_processes(self.inodes)]
                          if _alive(process)}.values())
        _signal(processes, signal.SIGKILL)
        _wait_gone(processes, popens, GRACE_S)
        left += [f"process {process.pid} ({' '.join(_cmdline(process))})" for process in processes]
        if left:
            raise AssertionError(f"network {self.prefix}* left behind: {'; '.join(left)}")


def _cmdline(process: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):
        return process.cmdline()
    return ["?"]


@contextlib.contextmanager
def network(hosts: list[str]) -> Iterator[Network]:
    """A network of `hosts` (host i at 10.231.0.(10+i)), taken down on exit whatever happened, and checked clean.

    Raises AssertionError on exit if a namespace, an interface or a process of it survived.
    """
    global _sequence
    if len(set(hosts)) != len(hosts) or not 0 < len(hosts) <= 254 - FIRST_HOST_OCTET:
        raise ValueError(f"host names must be distinct, 1 to {254 - FIRST_HOST_OCTET} of them: {hosts}")
    for name in hosts:
        if not HOST_NAME.match(name) or name == "switch":
            raise ValueError(f"host name {name!r}: want [a-z0-9_], at most 32 characters, not 'switch'")
    _remove_stale()
    _sequence += 1
    pid = os.getpid()
    prefix = f"gat-{pid}-{_sequence}-"
    switch = f"{prefix}switch"
    # Interface names have 15 characters at most; the PID makes them this process's, as the namespaces are.
    net = Network(prefix, {name: Host(name, f"{prefix}{name}", f"{SUBNET}.{FIRST_HOST_OCTET + index}", switch,
                                      f"gat{pid}v{index}")
                           for index, name in enumerate(hosts)})
    try:
        net._build()
        yield net
    finally:
        net._close()
