"""netns_support: hosts reach each other by address only, a cut link goes silent, and nothing outlives the network.

Each test builds its own 3-host network (a, b, c), about a tenth of a second, so no test sees another's cuts
or leftovers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Iterator

import psutil
import pytest
from netns_support import Host, Network, netns_unavailable, network, require_netns

PORT = 7070
WAIT_S = 10.0

# Echoes "<host>:<line>" to every connection, forever, so a reply says which host answered.
ECHO_SERVER = textwrap.dedent("""
    import socket, sys
    name, address, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    server = socket.create_server((address, port))
    while True:
        connection, _ = server.accept()
        with connection:
            connection.settimeout(5)
            data = connection.recv(1024)
            connection.sendall(name.encode() + b":" + data)
""")

# Prints "ok:<reply>", or what went wrong: "timeout", "refused", or "error:<exception>".
CLIENT = textwrap.dedent("""
    import socket, sys
    address, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    try:
        with socket.create_connection((address, port), timeout=timeout) as connection:
            connection.sendall(b"ping")
            print("ok:" + connection.recv(1024).decode())
    except socket.timeout:
        print("timeout")
    except ConnectionRefusedError:
        print("refused")
    except OSError as error:
        print(f"error:{error!r}")
""")


def connect(client: Host, address: str, port: int = PORT, timeout: float = 2.0) -> str:
    """What a client in `client` gets when it connects to address:port and sends "ping"."""
    result = client.run([sys.executable, "-c", CLIENT, address, str(port), str(timeout)], timeout=timeout + 30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def serve(host: Host, address: str, port: int = PORT) -> subprocess.Popen:
    """An echo server in `host` on address:port, once it answers there (from inside the host), within WAIT_S."""
    server = host.popen([sys.executable, "-c", ECHO_SERVER, host.name, address, str(port)])
    wait_answered(host, address, port, expected=f"ok:{host.name}:ping")
    return server


def wait_answered(client: Host, address: str, port: int = PORT, expected: str = "", wait: float = WAIT_S) -> str:
    """Poll from `client` until address:port replies (what it replied), at most `wait` seconds."""
    deadline = time.monotonic() + wait
    while True:
        reply = connect(client, address, port, timeout=1.0)
        if reply.startswith("ok:") or time.monotonic() > deadline:
            assert reply == expected or (not expected and reply.startswith("ok:")), f"{address}:{port}: {reply}"
            return reply
        time.sleep(0.1)


@pytest.fixture
def net() -> Iterator[Network]:
    require_netns()
    with network(["a", "b", "c"]) as built:
        yield built


def test_netns_unavailable_is_none_here() -> None:
    """As root with CAP_NET_ADMIN the probe succeeds; elsewhere this skips (or fails, with GAT_REQUIRE_NETNS=1)."""
    require_netns()
    assert netns_unavailable() is None
    assert netns_unavailable.cache_info().currsize == 1


def test_hosts_have_their_addresses_and_only_their_interfaces(net: Network) -> None:
    """`ip netns exec` remounts /sys, so even /sys/class/net shows the host's own interfaces."""
    for index, name in enumerate("abc"):
        host = net.hosts[name]
        assert host.address == f"10.231.0.{10 + index}"
        assert f"inet {host.address}/24" in host.run(["ip", "-o", "addr", "show", "eth0"]).stdout
        assert host.run("ls /sys/class/net").stdout.split() == ["eth0", "lo"]


def test_server_on_an_address_is_reached_from_another_host(net: Network) -> None:
    a, b = net.hosts["a"], net.hosts["b"]
    serve(a, a.address)
    assert connect(b, a.address) == "ok:a:ping"


def test_loopback_is_each_hosts_own(net: Network) -> None:
    """a and b each serve 127.0.0.1:PORT: b reaches only its own, and a's loopback is out of b's reach."""
    a, b = net.hosts["a"], net.hosts["b"]
    serve(a, "127.0.0.1")
    assert connect(b, "127.0.0.1") == "refused"
    assert connect(b, a.address) == "refused"
    serve(b, "127.0.0.1")
    assert connect(b, "127.0.0.1") == "ok:b:ping"
    assert connect(a, "127.0.0.1") == "ok:a:ping"


def test_cut_host_gets_no_answer_until_restored(net: Network) -> None:
    """A cut is a cable pulled, not a refusal: the SYN gets nothing back, so the connect times out."""
    a, b = net.hosts["a"], net.hosts["b"]
    server = serve(a, a.address)
    assert connect(b, a.address) == "ok:a:ping"
    a.cut()
    started = time.monotonic()
    reply = connect(b, a.address, timeout=2.0)
    assert reply == "timeout" or reply.startswith("error:"), reply
    assert time.monotonic() - started >= 1.5
    assert server.poll() is None
    a.restore()
    assert wait_answered(b, a.address) == "ok:a:ping"


def test_nothing_outlives_the_network() -> None:
    """Servers, a forgotten `sleep` and a detached grandchild in c: all stopped, namespaces and veths gone."""
    require_netns()
    with network(["a", "b", "c"]) as built:
        a, c = built.hosts["a"], built.hosts["c"]
        serve(a, a.address)
        sleeper = c.popen(["sleep", "1000"])
        c.run("setsid sleep 1001 >/dev/null 2>&1 < /dev/null &")
        pids = {pid for host in built.hosts.values() for pid in host.pids()}
        processes = [psutil.Process(pid) for pid in pids]
        assert sleeper.pid in c.pids()
        assert len(c.pids()) == 2
        namespaces, peers = built.namespaces, [host.peer for host in built.hosts.values()]
        assert set(namespaces) <= set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                     check=True).stdout.split())
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [name for name in namespaces if name in listed.split()]
    assert not [line for line in listed.splitlines() if line.startswith(built.prefix)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not [peer for peer in peers if f" {peer}:" in links or f" {peer}@" in links]
    assert sleeper.returncode == -15
    survivors = [process for process in processes
                 if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
    assert not survivors


def test_exit_on_exception_still_cleans_up() -> None:
    """Also a process that `ip netns exec` had not yet put in its namespace when the body raised."""
    require_netns()
    with pytest.raises(RuntimeError, match="boom"), network(["a"]) as built:
        sleeper = built.hosts["a"].popen(["sleep", "1000"])
        raise RuntimeError("boom")
    assert sleeper.returncode is not None
    assert not [name for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                 check=True).stdout.split() if name.startswith(built.prefix)]


def test_leftover_is_removed_and_reported() -> None:
    """A namespace under the network's prefix that it did not make is still removed, and named in the error."""
    require_netns()
    with pytest.raises(AssertionError, match="left behind: namespace gat-.*-extra"), network(["a"]) as built:
        extra = f"{built.prefix}extra"
        subprocess.run(["ip", "netns", "add", extra], check=True, timeout=30)
    assert extra not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                       check=True).stdout.split()
