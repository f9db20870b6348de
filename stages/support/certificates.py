"""Whether a TLS certificate on this host will be accepted, checked before connecting: readable, in its validity
period, and signed by the CA it is meant for. A handshake refused for such a reason says only "connection closed"
on the client's side, and nothing of why; this names the file and the problem in one line."""

from __future__ import annotations

import datetime
import re
import ssl
from pathlib import Path


def certificate_problem(cert_file: str | Path, ca_file: str | Path,
                        now: datetime.datetime | None = None) -> str | None:
    """What is wrong with `cert_file` as a certificate that `ca_file`'s CA must accept, or None."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    try:
        cert = x509.load_pem_x509_certificate(Path(cert_file).read_bytes())
        ca = x509.load_pem_x509_certificate(Path(ca_file).read_bytes())
    except (OSError, ValueError) as error:
        return f"cannot be read ({type(error).__name__}: {' '.join(str(error).split())[:120]})"
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if now > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if now < cert.not_valid_before_utc:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this host's clock right?)"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return (f"was not signed by the CA in {ca_file} (it was issued by "
                f"'{cert.issuer.rfc4514_string()}', that CA is '{ca.subject.rfc4514_string()}')")
    return None


def certificate_refused(error: BaseException) -> str | None:
    """Why TLS refused a server's certificate, if that is what `error` is, or what caused it: OpenSSL's reason
    (`certificate verify failed: <reason>`), as requests, urllib3 and Dask wrap it."""
    cause: BaseException | None = error
    for _ in range(8):  # requests -> urllib3 -> ssl: a few causes deep at most
        if cause is None:
            break
        if isinstance(cause, ssl.SSLCertVerificationError):
            return cause.verify_message or "certificate verify failed"
        found = re.search(r"certificate verify failed: ([^()\]'\"]+)", str(cause))
        if found:
            return found.group(1).strip()
        cause = cause.__cause__ or cause.__context__
    return None
