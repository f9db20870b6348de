"""The team backend's addresses and ports: every listener of the three servers, each port chosen free at start (the one
asked for in GAT_TEAM_*_PORT, else the last one, else any). The MLflow server and the S3 API listen on the address of
the team's host name (GAT_TEAM_HOST, default 127.0.0.1); everything else on 127.0.0.1 only."""

from __future__ import annotations

import os
import socket

from team.settings import LOOPBACK, TeamError, say

# Every listener of the three servers. SeaweedFS's gRPC ports default to HTTP port + 10000, and its S3 gateway
# also opens Iceberg and Lance endpoints on fixed ports, so all of them are chosen here.
# (The Iceberg and Lance endpoints are not started: port 0.)
PORT_NAMES = ("postgres", "mlflow", "s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer",
              "filer_grpc")
# The ports a user may ask for. An asked-for port that is taken is an error; any other taken port is replaced.
PORT_ENV = {"postgres": "GAT_TEAM_POSTGRES_PORT", "mlflow": "GAT_TEAM_MLFLOW_PORT", "s3": "GAT_TEAM_S3_PORT"}
# The listeners that take clients from other hosts, on the host name's address.
PUBLIC_PORTS = ("mlflow", "s3")
HOST_ENV = "GAT_TEAM_HOST"


def listen_address(host: str) -> str:
    """The IPv4 address the public listeners bind: `host` itself when it is one, else what the name resolves to,
    which must be an address of this machine."""
    try:
        address = socket.gethostbyname(host)
    except OSError as error:
        raise TeamError(f"{HOST_ENV}={host!r} does not resolve ({error}): set it to this host's name or address, "
                        "as the team's other hosts reach it") from None
    with socket.socket() as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            raise TeamError(f"{HOST_ENV}={host!r} is {address}, not an address of this host: set it to a name or "
                            "address of this host, as the team's other hosts reach it") from None
    return address


def _port_free(port: int, address: str) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def _any_free_port(taken: set[int], address: str) -> int:
    while True:
        with socket.socket() as probe:
            probe.bind((address, 0))
            port = probe.getsockname()[1]
        if port not in taken and port + 10000 not in taken:
            return port


def choose_ports(previous: dict[str, int], public_address: str = LOOPBACK) -> dict[str, int]:
    """A free port for every listener: the one asked for (GAT_TEAM_*_PORT), else the last one, else any."""
    chosen: dict[str, int] = {}
    for name in PORT_NAMES:
        address = public_address if name in PUBLIC_PORTS else LOOPBACK
        taken = set(chosen.values())
        asked = os.environ.get(PORT_ENV.get(name, ""), "")
        if asked:
            if not asked.isdigit() or not 0 < int(asked) < 65536:
                raise TeamError(f"{PORT_ENV[name]}={asked!r} is not a port number: set it to 1-65535 or unset it")
            port = int(asked)
            if port in taken or not _port_free(port, address):
                raise TeamError(f"port {port} ({PORT_ENV[name]}) is in use on {address}: free it, or set "
                                f"{PORT_ENV[name]} to another port (unset, a free one is picked)")
        elif name in previous and previous[name] not in taken and _port_free(previous[name], address):
            port = previous[name]
        else:
            port = _any_free_port(taken, address)
            if name in previous:
                say(f"port {previous[name]} ({name}) is in use on {address}: using {port} instead")
        chosen[name] = port
    return chosen
