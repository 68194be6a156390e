"""HTTPS: the server's TLS context, built from a PEM certificate and its private key."""

from __future__ import annotations

import ssl

KEY_MISMATCH = (
    "the private key does not belong to the certificate; give the key the certificate "
    "was issued for (openssl x509 -noout -pubkey -in CERT and openssl pkey -pubout "
    "-in KEY print the same key)"
)


class TLSError(Exception):
    """The certificate pair cannot be used; `part` is "cert" or "key", the message says what to
    do."""

    def __init__(self, part: str, message: str) -> None:
        super().__init__(message)
        self.part = part


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context holding the certificate (chain) and its private key."""
    for part, path in (("cert", cert_file), ("key", key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as err:
            raise TLSError(
                part,
                f"cannot read the file: {err.strerror or err}; "
                "give the path of a readable PEM file",
            ) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file, password=_encrypted)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise TLSError("key", KEY_MISMATCH) from None
        if not _has_certificate(cert_file):
            raise TLSError(
                "cert",
                "not a PEM certificate; give the file that begins with "
                "-----BEGIN CERTIFICATE----- (convert DER with openssl x509 "
                "-inform DER -in CERT -out CERT.pem)",
            ) from None
        raise TLSError(
            "key",
            "not a PEM private key; give the unencrypted key that begins with "
            "-----BEGIN PRIVATE KEY----- (or RSA/EC PRIVATE KEY)",
        ) from None
    except OSError as err:
        raise TLSError(
            "cert",
            f"cannot read the certificate pair: {err.strerror or err}; give readable PEM files",
        ) from None
    return context


def _encrypted() -> bytes:
    """Password callback: the agent has no passphrase to give, so an encrypted key is refused,
    never prompted."""
    raise TLSError(
        "key",
        "the private key is encrypted with a passphrase; store it unencrypted "
        "(openssl pkey -in KEY -out KEY.plain) and protect the file by its "
        "permissions",
    )


def _has_certificate(path: str) -> bool:
    """Whether the file holds at least one PEM certificate that parses."""
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=file.read(1 << 20))
    except (OSError, ValueError):
        return False
    return True
