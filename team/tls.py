"""The team's certificates: the CA that `make team-up` makes (its key stays on the server host, 0600), the servers'
certificate for the name clients reach them at, and the bundles the admin issues to colleagues, schedulers and
workers (`python -m team issue NAME`): a key and a certificate signed by the CA, good for TLS server and client use.

SeaweedFS's own mutual TLS (team.servers) uses a second, private CA whose key is thrown away; both are built here.
"""

from __future__ import annotations

import datetime
import ipaddress
import shlex
from dataclasses import dataclass
from pathlib import Path

from team.settings import LOOPBACK, State, TeamError, write_private

CA_NAME = "gat-repro team CA"
BUNDLE_ENV = "team.env"  # not `env`: `source env` would find /usr/bin/env on the PATH first
DAYS = 3650  # the backend's own certificates; a bundle's lifetime is the admin's choice (`issue --days`)


@dataclass(frozen=True)
class KeyPair:
    """A private key and its certificate, both as PEM text."""
    key_pem: str
    cert_pem: str

    def write(self, key_file: Path, cert_file: Path) -> None:
        """Both files 0600: the key is a secret, and a certificate is nobody else's business either."""
        write_private(key_file, self.key_pem)
        write_private(cert_file, self.cert_pem)


def _alternative_names(names: list[str]):
    """Subject alternative names: an IP address where a name parses as one, else a DNS name."""
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _pem(key, cert) -> KeyPair:
    from cryptography.hazmat.primitives import serialization

    return KeyPair(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption()).decode(),
        cert.public_bytes(serialization.Encoding.PEM).decode())


def make_ca(common_name: str = CA_NAME, days: int = DAYS) -> KeyPair:
    """A self-signed CA that may sign end-entity certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return _pem(key, cert)


def issue(ca: KeyPair, common_name: str, names: list[str], days: int = DAYS, *,
          valid_from: datetime.datetime | None = None) -> KeyPair:
    """A key and a certificate signed by `ca`, for TLS servers and clients alike, valid for `names` (host names or
    IP addresses) from `valid_from` (default: a day ago, against clock skew) for `days` days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_key = serialization.load_pem_private_key(ca.key_pem.encode(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey), "the team's CA key is an EC key (make_ca)"
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem.encode())
    start = valid_from or datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=1)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(_alternative_names(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem(key, cert)


def names_of(cert_file: Path) -> set[str]:
    """The host names and addresses a certificate is valid for."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(value) for value in sans.get_values_for_type(x509.DNSName) + sans.get_values_for_type(x509.IPAddress)}


def _ca(state: State) -> KeyPair:
    return KeyPair(state.ca_key.read_text(), state.ca_file.read_text())


def ensure_certificates(state: State, host: str) -> None:
    """The team's CA, made at the first start and kept; the servers' certificate, made again whenever it does not name
    `host` (GAT_TEAM_HOST changed) or has less than 30 days left."""
    state.tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not (state.ca_file.exists() and state.ca_key.exists()):
        make_ca().write(state.ca_key, state.ca_file)
        state.server_cert.unlink(missing_ok=True)
    state.ca_file.chmod(0o644)  # public: it is what every client trusts
    wanted = {host, LOOPBACK, "localhost"}
    if (not state.server_cert.exists() or not wanted <= names_of(state.server_cert)
            or _days_left(state.server_cert) < 30):
        issue(_ca(state), "gat-repro team servers", sorted(wanted)).write(state.server_key, state.server_cert)


def _days_left(cert_file: Path) -> float:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    return (cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)).total_seconds() / 86400


def issue_bundle(state: State, name: str, folder: Path, days: int, client_env: dict[str, str] | None) -> None:
    """A bundle for one host of the team, in `folder`: `ca.crt`, `<name>.crt` and `<name>.key` (signed by the team's
    CA: a Dask scheduler, worker or client), and `team.env`, to `source` there, which points Dask's TLS settings at them
    and, for a colleague (`client_env`), adds what `.team/env` has (the MLflow server, its login, the DVC remote),
    with the CA's path where the bundle is. The folder can be moved: `team.env` finds its files beside itself."""
    if not state.ca_key.exists():
        raise TeamError(f"no team CA in {state.tls}: run `make team-up` on the server host first")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    issue(_ca(state), name, [name], days).write(folder / f"{name}.key", folder / f"{name}.crt")
    write_private(folder / "ca.crt", state.ca_file.read_text())
    here = '"$here"'
    lines = [f"# gat-repro team: {name}'s certificate (valid {days} days), from `python -m team issue`. `source` it.",
             'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"']
    dask = {"REQUIRE_ENCRYPTION": "True", "TLS__CA_FILE": "ca.crt"} | {
        f"TLS__{role}__{part}": f"{name}.{suffix}" for role in ("CLIENT", "WORKER", "SCHEDULER")
        for part, suffix in (("CERT", "crt"), ("KEY", "key"))}
    for key, value in dask.items():
        shown = value if value == "True" else f'{here}/{shlex.quote(value)}'
        lines.append(f"export DASK_DISTRIBUTED__COMM__{key}={shown}")
    for key, value in (client_env or {}).items():
        shown = f'{here}/ca.crt' if value == str(state.ca_file) else shlex.quote(value)
        lines.append(f"export {key}={shown}")
    write_private(folder / BUNDLE_ENV, "\n".join(lines) + "\n")
