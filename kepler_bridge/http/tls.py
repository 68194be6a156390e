"""HTTPS: the server's TLS context, built from a PEM certificate and its private key, and re-read
when either file changes."""

from __future__ import annotations

import logging
import re
import shlex
import ssl
import threading

from kepler_bridge.http.kept_files import KeptFiles
from kepler_bridge.reload import ConfigFileWatch

log = logging.getLogger(__name__)

KEY_MISMATCH = (
    "the private key does not belong to the certificate; give the key the certificate "
    "was issued for (openssl x509 -noout -pubkey -in CERT and openssl pkey -pubout "
    "-in KEY print the same key)"
)
# Only this much of a file is looked at to say what is wrong with it.
DIAGNOSE_BYTES = 1 << 20
_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL
)


class TLSError(Exception):
    """The certificate pair cannot be used; `part` is "cert" or "key", the message says what to
    do."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context holding the certificate (chain) and its private key."""
    heads = {part: _head(part, path) for part, path in (("cert", cert_file), ("key", key_file))}
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file, password=_encrypted)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise TLSError("key", KEY_MISMATCH) from None
        cert_problem = _certificate_problem(cert_file, heads["cert"])
        if cert_problem:
            raise TLSError("cert", cert_problem) from None
        raise TLSError("key", _key_problem(key_file, heads["key"])) from None
    except OSError as err:
        raise TLSError(
            "cert",
            f"cannot read the certificate pair: {err.strerror or err}; give readable PEM files",
        ) from None
    return context


def _head(part: str, path: str) -> bytes:
    """The first bytes of a file of the pair, which say what it holds when it does not load."""
    try:
        with open(path, "rb") as file:
            return file.read(DIAGNOSE_BYTES)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        reason = err.strerror if isinstance(err, OSError) and err.strerror else err
        raise TLSError(
            part, f"cannot read the file: {reason}; give the path of a readable PEM file"
        ) from None


def _certificate_problem(path: str, head: bytes) -> str:
    """What is wrong with a certificate file; "" when it holds a PEM certificate that parses."""
    pem = b"\n".join(_PEM_CERTIFICATE.findall(head))
    if pem and _parses(pem.decode("latin-1")):
        return ""
    if not head.strip():
        return "the file is empty; give the PEM certificate (-----BEGIN CERTIFICATE-----)"
    if _parses(head):
        return (
            "not a PEM certificate: it is in DER (binary) form; convert it with openssl x509 "
            f"-inform der {_in_out(path)} and give that file"
        )
    return (
        "not a PEM certificate; give the file that begins with -----BEGIN CERTIFICATE----- "
        "(convert DER with openssl x509 -inform der -in CERT -out CERT.pem)"
    )


def _key_problem(path: str, head: bytes) -> str:
    """What is wrong with a private key file that did not load beside a good certificate."""
    if not head.strip():
        return "the file is empty; give the PEM private key (-----BEGIN PRIVATE KEY-----)"
    if head[:1] == b"\x30" and b"-----BEGIN" not in head:  # an ASN.1 SEQUENCE: DER
        return (
            "not a PEM private key: it is in DER (binary) form; convert it with openssl pkey "
            f"-inform der {_in_out(path)} and give that file"
        )
    return (
        "not a PEM private key; give the unencrypted key that begins with "
        "-----BEGIN PRIVATE KEY----- (or RSA/EC PRIVATE KEY)"
    )


def _in_out(path: str) -> str:
    """openssl's -in and -out for converting `path` to PEM beside it."""
    pem = re.sub(r"\.(der|cer)$", "", path, flags=re.IGNORECASE) + ".pem"
    return f"-in {shlex.quote(path)} -out {shlex.quote(pem)}"


def _parses(cadata: str | bytes) -> bool:
    """Whether `cadata` holds at least one certificate: PEM text, or DER bytes."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cadata)
    except (ssl.SSLError, ValueError, TypeError):
        return False
    return True


def _encrypted() -> bytes:
    """Password callback: the agent has no passphrase to give, so an encrypted key is refused,
    never prompted."""
    raise TLSError(
        "key",
        "the private key is encrypted with a passphrase; store it unencrypted "
        "(openssl pkey -in KEY -out KEY.plain) and protect the file by its "
        "permissions",
    )


class CertificatePair:
    """`--tls-cert`/`--tls-key` as of their last good read; `current()` re-reads them when either
    file changed."""

    def __init__(self, cert_file: str, key_file: str, kept: KeptFiles | None = None) -> None:
        """`kept`: the pair as the agent started with it, served while the files do not load."""
        self.files = {"cert": cert_file, "key": key_file}
        self._lock = threading.Lock()
        self._watch = ConfigFileWatch(cert_file, key_file)
        try:
            self._context = server_context(cert_file, key_file)
        except TLSError as err:
            if kept is None or cert_file not in kept or key_file not in kept:
                raise
            log.warning(
                "tls_%s %s does not load, the certificate pair the agent started with is "
                "served: %s",
                err.part,
                self.files[err.part],
                err,
            )
            self._context = server_context(kept.path(cert_file), kept.path(key_file))

    def current(self) -> ssl.SSLContext:
        """The context in force; a changed pair that does not load is refused with one log line
        and the last good one kept."""
        with self._lock:
            if self._watch.changed():
                self._reread()
            return self._context

    def _reread(self) -> None:
        try:
            self._context = server_context(self.files["cert"], self.files["key"])
        except TLSError as err:
            log.warning(
                "tls_%s %s not reloaded, the previous certificate pair stays in force: %s",
                err.part,
                self.files[err.part],
                err,
            )
            return
        log.info("certificate pair %s, %s reloaded", self.files["cert"], self.files["key"])
