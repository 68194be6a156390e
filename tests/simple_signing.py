"""GPG "simple signing" of container images, which Debian's podman makes (`push --sign-by`) and
enforces itself (containers/image's `signedBy` policy requirement), for tests/test_image.py.

Everything lives in temporary folders: a throw-away GNUPGHOME, the lookaside folder the signatures
are written to and read from, and the registries.d that names it (under a private $HOME). The
machine's keyrings and /etc/containers are neither read nor changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class Keyring:
    """A throw-away GNUPGHOME holding one signing key without a passphrase; a context manager that
    stops its gpg-agent and removes it."""

    def __init__(self, name: str) -> None:
        # Short, under /tmp: gpg-agent's socket lies in it (socket paths are limited to 108 bytes).
        self.home = Path(tempfile.mkdtemp(prefix="kb-gnupg-", dir="/tmp"))
        # Uncompressed, the signed payload is readable in the signature file (to forge one).
        (self.home / "gpg.conf").write_text("compress-algo none\n")
        self.gpg(
            "--quick-gen-key", f"{name} <release@kepler-bridge.invalid>", "ed25519", "sign", "never"
        )
        listed = self.gpg("--list-keys", "--with-colons").stdout
        self.fingerprint = next(
            line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:")
        )

    def gpg(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["gpg", "--batch", "--passphrase", "", *args],
            env={**os.environ, "GNUPGHOME": str(self.home)},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )

    def export(self, path: Path) -> Path:
        """The public key, armored, where a policy's `keyPath` can name it."""
        path.write_text(self.gpg("--armor", "--export", self.fingerprint).stdout)
        return path

    def __enter__(self) -> "Keyring":
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run(
            ["gpgconf", "--kill", "gpg-agent"],
            env={**os.environ, "GNUPGHOME": str(self.home)},
            capture_output=True,
            timeout=30,
        )
        shutil.rmtree(self.home, ignore_errors=True)


def lookaside(home: Path, registry: str, directory: Path) -> None:
    """The registries.d under `home`/.config (containers/image reads it there before
    /etc/containers) that has podman write and read `registry`'s signatures in `directory`."""
    registries = home / ".config" / "containers" / "registries.d"
    registries.mkdir(parents=True, exist_ok=True)
    url = directory.as_uri()
    (registries / "simple-signing.yaml").write_text(
        f"docker:\n  {registry}:\n    sigstore-staging: {url}\n    sigstore: {url}\n"
    )


def signature_file(directory: Path, repo: str, digest: str) -> Path:
    """Where the lookaside `directory` holds the first signature of `repo`@`digest`."""
    return directory / f"{repo}@{digest.replace(':', '=')}" / "signature-1"


def signed_by_policy(path: Path, public_key: Path, *scopes: str) -> Path:
    """A containers-policy.json that rejects every image but those of `scopes` (registry/repo)
    signed with the key."""
    signed = {"type": "signedBy", "keyType": "GPGKeys", "keyPath": str(public_key)}
    policy = {
        "default": [{"type": "reject"}],
        "transports": {"docker": {scope: [signed] for scope in scopes}},
    }
    path.write_text(json.dumps(policy, indent=2))
    return path
