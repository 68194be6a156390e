"""Sigstore signatures of container images as cosign makes them, and the policy that admits only
signed images, for tests/test_image.py.

Debian bookworm has no cosign, and its podman and skopeo (containers/image 5.23.1) are built with
sigstore disabled: both signing (`--sign-by-sigstore-private-key`) and the `sigstoreSigned` policy
check stop with "Debian-local change: sigstore disabled". So this module writes what
`cosign generate-key-pair` and `cosign sign --key` write, byte for byte in format (an encrypted
P-256 key; a simple-signing payload in a `sha256-<digest>.sig` attachment of the registry), and
checks a signature as `cosign verify --key` and containers/image's `sigstoreSigned` requirement
with `matchRepository` do. The key and signature arithmetic is the openssl CLI's. What admits a
signature here is this module, not podman: tests/simple_signing.py has podman's own policy engine
admit and refuse images signed with GPG.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import nacl.secret
import requests

from scaffold import free_port

PAYLOAD_TYPE = "cosign container image signature"
SIMPLE_SIGNING = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MANIFESTS = (OCI_MANIFEST, "application/vnd.docker.distribution.manifest.v2+json")
# go-securesystemslib's "encrypted" envelope, as cosign uses it: scrypt, then NaCl secretbox.
SCRYPT = {"N": 32768, "r": 8, "p": 1}


def _openssl(*args: str, data: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run(["openssl", *args], input=data, capture_output=True, timeout=60)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _scrypt(password: bytes, salt: bytes) -> bytes:
    n, r, p = SCRYPT["N"], SCRYPT["r"], SCRYPT["p"]
    return hashlib.scrypt(password, salt=salt, n=n, r=r, p=p, maxmem=256 * n * r, dklen=32)


def _pem(kind: str, body: bytes) -> str:
    text = _b64(body)
    lines = [text[i : i + 64] for i in range(0, len(text), 64)]
    return "\n".join([f"-----BEGIN {kind}-----", *lines, f"-----END {kind}-----", ""])


def generate_key_pair(prefix: Path, password: str) -> tuple[Path, Path]:
    """`cosign generate-key-pair`: <prefix>.key (ENCRYPTED SIGSTORE PRIVATE KEY) and
    <prefix>.pub."""
    der = _openssl(
        "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-outform", "DER"
    ).stdout
    public = _openssl("pkey", "-inform", "DER", "-pubout", data=der).stdout
    salt, nonce = os.urandom(32), os.urandom(24)
    box = nacl.secret.SecretBox(_scrypt(password.encode(), salt)).encrypt(der, nonce)
    envelope = {
        "kdf": {"name": "scrypt", "params": SCRYPT, "salt": _b64(salt)},
        "cipher": {"name": "nacl/secretbox", "nonce": _b64(nonce)},
        "ciphertext": _b64(box.ciphertext),
    }
    key, pub = prefix.with_suffix(".key"), prefix.with_suffix(".pub")
    key.write_text(_pem("ENCRYPTED SIGSTORE PRIVATE KEY", json.dumps(envelope).encode()))
    key.chmod(0o600)
    pub.write_bytes(public)
    return key, pub


def _private_der(key: Path, password: str) -> bytes:
    body = "".join(key.read_text().splitlines()[1:-1])
    envelope = json.loads(base64.b64decode(body))
    secret = _scrypt(password.encode(), base64.b64decode(envelope["kdf"]["salt"]))
    return nacl.secret.SecretBox(secret).decrypt(
        base64.b64decode(envelope["ciphertext"]), base64.b64decode(envelope["cipher"]["nonce"])
    )


class Registry:
    """Debian's docker-registry on a loopback port, its storage under `directory`; a context
    manager that stops it."""

    def __init__(self, directory: Path) -> None:
        self.host = f"127.0.0.1:{free_port()}"
        config = directory / "registry.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {directory / 'storage'}\n"
            f"http:\n  addr: {self.host}\n"
        )
        self.log = directory / "registry.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [shutil.which("docker-registry") or "docker-registry", "serve", str(config)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait()

    def _wait(self) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if requests.get(f"http://{self.host}/v2/", timeout=2).status_code == 200:
                    return
            except requests.ConnectionError:
                time.sleep(0.2)
        self.close()
        raise RuntimeError(f"docker-registry did not start:\n{self.log.read_text()[-2000:]}")

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _url(self, repo: str, what: str) -> str:
        return f"http://{self.host}/v2/{repo}/{what}"

    def _manifest(self, repo: str, reference: str) -> bytes:
        answer = requests.get(
            self._url(repo, f"manifests/{reference}"), headers={"Accept": ",".join(MANIFESTS)}
        )
        answer.raise_for_status()
        return answer.content

    def manifest(self, repo: str, reference: str) -> dict:
        return json.loads(self._manifest(repo, reference))

    def digest(self, repo: str, reference: str) -> str:
        """The digest of a tag's manifest, computed from its bytes (not taken from a header)."""
        return "sha256:" + hashlib.sha256(self._manifest(repo, reference)).hexdigest()

    def put_blob(self, repo: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        upload = requests.post(self._url(repo, "blobs/uploads/"))
        upload.raise_for_status()
        location = upload.headers["Location"]
        if not location.startswith("http"):
            location = f"http://{self.host}{location}"
        requests.put(location, params={"digest": digest}, data=data).raise_for_status()
        return digest

    def blob(self, repo: str, digest: str) -> bytes:
        answer = requests.get(self._url(repo, f"blobs/{digest}"))
        answer.raise_for_status()
        return answer.content

    def signatures(self, repo: str, digest: str) -> dict | None:
        """The sigstore attachment of a manifest (cosign's `sha256-<hex>.sig` tag), or None."""
        answer = requests.get(
            self._url(repo, f"manifests/{signature_tag(digest)}"), headers={"Accept": OCI_MANIFEST}
        )
        if answer.status_code == 404:
            return None
        answer.raise_for_status()
        return answer.json()

    def put_signatures(self, repo: str, digest: str, attachment: dict) -> None:
        requests.put(
            self._url(repo, f"manifests/{signature_tag(digest)}"),
            data=json.dumps(attachment).encode(),
            headers={"Content-Type": OCI_MANIFEST},
        ).raise_for_status()


def signature_tag(digest: str) -> str:
    return digest.replace(":", "-") + ".sig"


def sign(registry: Registry, repo: str, reference: str, key: Path, password: str) -> dict:
    """`cosign sign --key`: a signature of the manifest `reference` names, attached to it in the
    registry; returns the attachment."""
    digest = registry.digest(repo, reference)
    payload = json.dumps(
        {
            "critical": {
                "identity": {"docker-reference": f"{registry.host}/{repo}"},
                "image": {"docker-manifest-digest": digest},
                "type": PAYLOAD_TYPE,
            },
            "optional": None,
        }
    ).encode()
    with tempfile.NamedTemporaryFile() as der:
        der.write(_private_der(key, password))
        der.flush()
        signed = _openssl("dgst", "-sha256", "-keyform", "DER", "-sign", der.name, data=payload)
    signed.check_returncode()
    layer = registry.put_blob(repo, payload)
    config = json.dumps(
        {
            "architecture": "",
            "os": "",
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [layer]},
        }
    ).encode()
    attachment = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "size": len(config),
            "digest": registry.put_blob(repo, config),
        },
        "layers": [
            {
                "mediaType": SIMPLE_SIGNING,
                "size": len(payload),
                "digest": layer,
                "annotations": {SIGNATURE_ANNOTATION: _b64(signed.stdout)},
            }
        ],
    }
    registry.put_signatures(repo, digest, attachment)
    return attachment


def refusal(policy: Path, registry: Registry, repo: str, reference: str) -> str:
    """Why a containers-policy.json file refuses an image ('' when it admits it): the `reject`,
    `insecureAcceptAnything` and `sigstoreSigned` (keyPath, matchRepository) requirements of the
    image's repository scope, else of `default`."""
    rules = json.loads(policy.read_text())
    scopes = rules.get("transports", {}).get("docker", {})
    for requirement in scopes.get(f"{registry.host}/{repo}", rules["default"]):
        kind = requirement["type"]
        if kind == "reject":
            return "rejected by the policy"
        if kind == "sigstoreSigned":
            assert requirement["signedIdentity"] == {"type": "matchRepository"}, requirement
            why = _unverified(registry, repo, reference, Path(requirement["keyPath"]))
            if why:
                return why
        elif kind != "insecureAcceptAnything":
            raise ValueError(f"requirement {kind} is not checked here")
    return ""


def _unverified(registry: Registry, repo: str, reference: str, public_key: Path) -> str:
    """`cosign verify --key`: '' when one signature attached to the manifest verifies with the key
    and names this manifest and repository, else why none does."""
    digest = registry.digest(repo, reference)
    attachment = registry.signatures(repo, digest)
    if attachment is None:
        return "a signature was required, but no signature exists"
    reasons = []
    for layer in attachment["layers"]:
        payload = registry.blob(repo, layer["digest"])
        reasons.append(
            _payload_problem(payload, layer, public_key, digest, f"{registry.host}/{repo}")
        )
        if not reasons[-1]:
            return ""
    return "; ".join(reasons)


def _payload_problem(
    payload: bytes, layer: dict, public_key: Path, digest: str, repository: str
) -> str:
    if layer["mediaType"] != SIMPLE_SIGNING:
        return f"not a simple-signing payload: {layer['mediaType']}"
    with tempfile.TemporaryDirectory() as scratch:
        signature, data = Path(scratch, "signature"), Path(scratch, "payload")
        signature.write_bytes(base64.b64decode(layer["annotations"][SIGNATURE_ANNOTATION]))
        data.write_bytes(payload)
        checked = _openssl(
            "dgst", "-sha256", "-verify", str(public_key), "-signature", str(signature), str(data)
        )
    if checked.returncode != 0:
        return "the signature does not verify with the key"
    critical = json.loads(payload)["critical"]
    if critical["type"] != PAYLOAD_TYPE:
        return f"payload type {critical['type']!r}"
    if critical["image"]["docker-manifest-digest"] != digest:
        return f"the signature is for {critical['image']['docker-manifest-digest']}, not {digest}"
    if critical["identity"]["docker-reference"] != repository:
        return f"the signature is for {critical['identity']['docker-reference']}, not {repository}"
    return ""
