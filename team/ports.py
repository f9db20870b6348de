"""The team backend's ports on 127.0.0.1: every listener of the three servers, each chosen free at start (the one
asked for in GAT_TEAM_*_PORT, else the last one, else any)."""

from __future__ import annotations

import os
import socket

from team.settings import TeamError, say

# Every listener of the three servers. SeaweedFS's gRPC ports default to HTTP port + 10000, and its S3 gateway
# also opens Iceberg and Lance endpoints on fixed ports, so all of them are chosen here.
# (The Iceberg and Lance endpoints are not started: port 0.)
PORT_NAMES = ("postgres", "mlflow", "s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer",
              "filer_grpc")
# The ports a user may ask for. An asked-for port that is taken is an error; any other taken port is replaced.
PORT_ENV = {"postgres": "GAT_TEAM_POSTGRES_PORT", "mlflow": "GAT_TEAM_MLFLOW_PORT", "s3": "GAT_TEAM_S3_PORT"}


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in taken and port + 10000 not in taken:
            return port


def choose_ports(previous: dict[str, int]) -> dict[str, int]:
    """A free port for every listener: the one asked for (GAT_TEAM_*_PORT), else the last one, else any."""
    chosen: dict[str, int] = {}
    for name in PORT_NAMES:
        taken = set(chosen.values())
        asked = os.environ.get(PORT_ENV.get(name, ""), "")
        if asked:
            if not asked.isdigit() or not 0 < int(asked) < 65536:
                raise TeamError(f"{PORT_ENV[name]}={asked!r} is not a port number: set it to 1-65535 or unset it")
            port = int(asked)
            if port in taken or not _port_free(port):
                raise TeamError(f"port {port} ({PORT_ENV[name]}) is in use on 127.0.0.1: free it, or set "
                                f"{PORT_ENV[name]} to another port (unset, a free one is picked)")
        elif name in previous and previous[name] not in taken and _port_free(previous[name]):
            port = previous[name]
        else:
            port = _any_free_port(taken)
            if name in previous:
                say(f"port {previous[name]} ({name}) is in use on 127.0.0.1: using {port} instead")
        chosen[name] = port
    return chosen
