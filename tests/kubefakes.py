"""A fake kubelet / API server / MetaServer (pod lists over HTTP or HTTPS with a token check)
and a fake kubelet pod-resources socket (gRPC) for tests."""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterable, Iterator

import grpc


def pod(
    namespace: str,
    name: str,
    *containers: tuple[str, str],
    node: str = "edge-1",
    init: tuple[tuple[str, str], ...] = (),
) -> dict:
    """A v1 Pod as the kubelet lists it; containers are (name, runtime://id),
    an empty id means not started."""

    def statuses(items: tuple[tuple[str, str], ...]) -> list[dict]:
        return [
            {"name": cname, **({"containerID": cid} if cid else {}), "ready": bool(cid)}
            for cname, cid in items
        ]

    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"nodeName": node, "containers": [{"name": cname} for cname, _ in containers]},
        "status": {
            "phase": "Running",
            "containerStatuses": statuses(containers),
            "initContainerStatuses": statuses(init),
        },
    }


def pod_list(*pods: dict) -> dict:
    return {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(pods)}


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (also usable as its own CA) and its key,
    made with the openssl CLI."""
    cert, key = directory / "kubelet.crt", directory / "kubelet.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=fake-kubelet",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def huge_pod_list(size: int) -> Iterator[bytes]:
    """A whole HTTP answer (no Content-Length) carrying a valid PodList of about `size` bytes,
    made while it is sent: never more than 1 MiB of it exists at once."""
    padding = {"annotations": {"note": "x" * 4000}}
    one = json.dumps({**pod("big", "filler", ("main", "containerd://" + "e" * 64)), **padding})
    chunk = ",".join([one] * (2**20 // len(one))).encode()
    yield b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n"
    yield b'{"kind":"PodList","apiVersion":"v1","metadata":{},"items":[' + chunk
    for _ in range(size // len(chunk)):
        yield b"," + chunk
    yield b"]}"


def dribbled(answer: bytes, every: float) -> Iterator[bytes]:
    """`answer` one byte every `every` seconds."""
    for index in range(len(answer)):
        time.sleep(every)
        yield answer[index : index + 1]


def http_answer(body: dict) -> bytes:
    """A whole HTTP answer: 200, JSON, with its Content-Length."""
    data = json.dumps(body).encode()
    head = f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
    return head.encode() + b"\r\n\r\n" + data


class FakeKube:
    """Answers GET /pods (kubelet) and /api/v1/pods (API server, MetaServer) with `pods`;
    records requests and counts answers. Where `raw` is set, each GET gets what it yields
    instead, written as it comes (status line, headers and body: a huge or a dribbled answer)."""

    def __init__(self, pods: dict, token: str = "", tls: tuple[Path, Path] | None = None) -> None:
        self.pods = pods
        self.token = token
        self.raw: Callable[[], Iterable[bytes]] | None = None
        self.requests: list[tuple[str, str]] = []
        self.answered = 0  # requests whose answer was written whole, or cut by the client
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake.requests.append((self.path, self.headers.get("Authorization", "")))
                try:
                    self._answer_request()
                finally:
                    fake.answered += 1

            def _answer_request(self) -> None:
                if fake.raw is not None:
                    self._write(fake.raw())
                elif fake.token and self.headers.get("Authorization") != f"Bearer {fake.token}":
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

            def _write(self, pieces: Iterable[bytes]) -> None:
                self.close_connection = True
                try:
                    for piece in pieces:
                        self.wfile.write(piece)
                except OSError:  # the client stopped reading and closed
                    pass

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
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeKube":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _varint(value: int) -> bytes:
    out = b""
    while True:
        byte, value = value & 0x7F, value >> 7
        out += bytes([byte | (0x80 if value else 0)])
        if not value:
            return out


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field, encoded by hand so the test does not trust the agent's schema."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def list_response(
    pods: list[tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]],
) -> bytes:
    """ListPodResourcesResponse with k8s.io/kubelet's field numbers,
    plus fields the agent does not read (cpu_ids, memory, topology), which it must skip."""
    body = b""
    for namespace, name, containers in pods:
        pod = _field(1, name.encode()) + _field(2, namespace.encode())
        for container_name, devices in containers:
            container = _field(1, container_name.encode())
            for resource, ids in devices:
                device = _field(1, resource.encode()) + b"".join(_field(2, i.encode()) for i in ids)
                container += _field(
                    2, device + _field(3, _field(1, _varint(1 << 3) + _varint(0)))
                )  # topology
            container += _field(3, _varint(4) + _varint(5))  # cpu_ids, packed
            container += _field(
                4, _field(1, b"memory") + _varint(2 << 3) + _varint(1 << 30)
            )  # memory
            pod += _field(3, container)
        body += _field(1, pod)
    return body


class FakePodResources:
    """v1.PodResourcesLister/List on a unix socket, answering `response` (bytes)."""

    def __init__(
        self, socket: Path, response: bytes, service: str = "v1.PodResourcesLister"
    ) -> None:
        self.socket = socket
        self.response = response
        self.delay = 0.0  # seconds each answer waits
        self.calls = 0
        self._lock = threading.Lock()

        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            with self._lock:
                self.calls += 1
            time.sleep(self.delay)
            return self.response

        handler = grpc.method_handlers_generic_handler(
            service, {"List": grpc.unary_unary_rpc_method_handler(answer)}
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
        self.server.add_insecure_port(f"unix://{socket}")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)

    def __enter__(self) -> "FakePodResources":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
