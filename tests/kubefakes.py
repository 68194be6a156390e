"""A fake kubelet / API server / MetaServer (pod lists over HTTP or HTTPS with a token check) for tests."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def pod(namespace: str, name: str, *containers: tuple[str, str], node: str = "edge-1",
        init: tuple[tuple[str, str], ...] = ()) -> dict:
    """A v1 Pod as the kubelet lists it; containers are (name, runtime://id), an empty id means not started."""
    def statuses(items: tuple[tuple[str, str], ...]) -> list[dict]:
        return [{"name": cname, **({"containerID": cid} if cid else {}), "ready": bool(cid)} for cname, cid in items]

    return {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
            "spec": {"nodeName": node, "containers": [{"name": cname} for cname, _ in containers]},
            "status": {"phase": "Running", "containerStatuses": statuses(containers),
                       "initContainerStatuses": statuses(init)}}


def pod_list(*pods: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(pods)}


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (also usable as its own CA) and its key, made with the openssl CLI."""
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                    "/CN=fake-kubelet", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


class FakeKube:
    """Answers GET /pods (kubelet) and /api/v1/pods (API server, MetaServer) with `pods`; records requests."""

    def __init__(self, pods: dict, token: str = "", tls: tuple[Path, Path] | None = None) -> None:
        self.pods = pods
        self.token = token
        self.requests: list[tuple[str, str]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append((self.path, self.headers.get("Authorization", "")))
                if fake.token and self.headers.get("Authorization") != f"Bearer {fake.token}":
                    self._answer(401, {"kind": "Status", "message": "Unauthorized"})
                elif self.path.split("?")[0] in ("/pods", "/api/v1/pods"):
                    self._answer(200, fake.pods)
                else:
                    self._answer(404, {"kind": "Status", "message": "not found"})

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.port = self.server.server_address[1]
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeKube":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
