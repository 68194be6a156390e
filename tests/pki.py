"""A throw-away certificate authority for TLS tests, made with the openssl CLI."""

from __future__ import annotations

import subprocess
from pathlib import Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


class Authority:
    """A CA in `directory` that issues server and client certificates."""

    def __init__(self, directory: Path, name: str = "test-ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.cert, self.key = directory / f"{name}.crt", directory / f"{name}.key"
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(self.key),
            "-out",
            str(self.cert),
        )

    def issue(self, name: str, san: str) -> tuple[Path, Path]:
        """A certificate for `san` (e.g. IP:127.0.0.1 or DNS:scraper) signed by this CA,
        and its key."""
        cert, key, request = (
            self.directory / f"{name}{suffix}" for suffix in (".crt", ".key", ".csr")
        )
        _openssl(
            "req",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            str(key),
            "-out",
            str(request),
        )
        extensions = self.directory / f"{name}.ext"
        extensions.write_text(f"subjectAltName={san}\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            str(request),
            "-CA",
            str(self.cert),
            "-CAkey",
            str(self.key),
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            str(extensions),
            "-out",
            str(cert),
        )
        return cert, key


def der(pem: Path, kind: str = "x509") -> Path:
    """The DER (binary) form of a PEM certificate (`kind` "x509") or private key ("pkey"),
    beside it."""
    out = pem.with_suffix(pem.suffix + ".der")
    _openssl(kind, "-in", str(pem), "-outform", "der", "-out", str(out))
    return out
