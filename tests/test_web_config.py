"""--web.config.file (exporter-toolkit format) through the real agent.

It covers TLS, mTLS, basic auth and rotation.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import time
from pathlib import Path

import bcrypt
import pytest
import requests
import yaml

from agent import KEPLER_BRIDGE, Agent
from kepler_bridge.http.passwords import PasswordCheck
from kepler_bridge.http.webconfig import WebConfigError, read
from pki import Authority

PASSWORD = "s3cret pass"


def _hash(password: str, rounds: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def _write(path: Path, data: dict) -> Path:
    # Written beside, then renamed: a reader never sees half a file
    # (as a Kubernetes secret update does).
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(data))
    temporary.replace(path)
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    directory = tmp_path_factory.mktemp("pki")
    ca, stranger = Authority(directory / "ca"), Authority(directory / "other", "other-ca")
    return {
        "ca": (ca.cert, ca.key),
        "server": ca.issue("server", "IP:127.0.0.1"),
        "scraper": ca.issue("scraper", "DNS:scraper"),
        "intruder": ca.issue("intruder", "DNS:intruder"),
        "stranger": stranger.issue("stranger", "DNS:scraper"),
        "server2": ca.issue("server2", "IP:127.0.0.1"),
    }


def _tls(pki: dict, **extra: object) -> dict:
    server_cert, server_key = pki["server"]
    return {
        "tls_server_config": {"cert_file": str(server_cert), "key_file": str(server_key), **extra}
    }


def _agent(web_config: Path, ca: Path | None, client: tuple[Path, Path] | None = None) -> Agent:
    return Agent(
        "--simulate",
        "1",
        "--sources",
        "simulated",
        "--interval",
        "0.5s",
        "--web.config.file",
        str(web_config),
        ca=str(ca) if ca else "",
        client_cert=(str(client[0]), str(client[1])) if client else None,
    )


def _served_certificate(port: int, ca: Path) -> bytes:
    context = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        return tls.getpeercert(binary_form=True)


def _refused(agent: Agent, client: tuple[Path, Path] | None, path: str = "/healthz") -> bool:
    try:
        requests.get(
            agent.url + path,
            verify=str(agent.verify),
            timeout=5,
            cert=(str(client[0]), str(client[1])) if client else None,
        )
    except requests.ConnectionError:
        return True
    return False


@pytest.mark.e2e
def test_mutual_tls_admits_only_clients_the_ca_signed(tmp_path: Path, pki: dict) -> None:
    ca = pki["ca"][0]
    web = _write(
        tmp_path / "web.yml",
        _tls(pki, client_ca_file=str(ca), client_auth_type="RequireAndVerifyClientCert"),
    )
    with _agent(web, ca, pki["scraper"]) as agent:
        assert agent.get("/metrics").status_code == 200
        assert _refused(agent, None), "a client without a certificate was served"
        assert _refused(agent, pki["stranger"]), "a certificate from another CA was accepted"
        assert agent.get("/v1/collect").status_code == 200


@pytest.mark.e2e
def test_client_allowed_sans_limit_which_certificates_are_served(tmp_path: Path, pki: dict) -> None:
    ca = pki["ca"][0]
    web = _write(
        tmp_path / "web.yml", _tls(pki, client_ca_file=str(ca), client_allowed_sans=["scraper"])
    )
    with _agent(web, ca, pki["scraper"]) as agent:
        assert agent.get("/metrics").status_code == 200
        assert _refused(agent, pki["intruder"]), "a certificate naming another client was served"


@pytest.mark.e2e
def test_basic_auth_users_guard_metrics_and_the_page_but_not_probes_or_collect(
    tmp_path: Path,
) -> None:
    web = _write(tmp_path / "web.yml", {"basic_auth_users": {"alice": _hash(PASSWORD)}})
    with _agent(web, None) as agent:
        assert agent.get("/metrics", auth=("alice", PASSWORD)).status_code == 200
        for auth in (None, ("alice", "wrong"), ("mallory", PASSWORD)):
            response = agent.get("/metrics", auth=auth)
            assert response.status_code == 401, auth
            assert response.headers["WWW-Authenticate"].startswith("Basic")
        assert agent.get("/", auth=("alice", "wrong")).status_code == 401
        for path in ("/healthz", "/readyz", "/v1/collect"):
            assert agent.get(path).status_code == 200, path


@pytest.mark.e2e
def test_tls_flags_beside_a_web_config_of_users_keep_the_port_tls_only(
    tmp_path: Path, pki: dict
) -> None:
    web = _write(tmp_path / "web.yml", {"basic_auth_users": {"alice": _hash(PASSWORD)}})
    cert, key = pki["server"]
    flags = ("--tls-cert", str(cert), "--tls-key", str(key))
    with Agent(
        "--simulate", "1", "--sources", "simulated", "--web.config.file", str(web), *flags,
        ca=str(pki["ca"][0]),
    ) as agent:  # fmt: skip
        assert agent.get("/metrics", auth=("alice", PASSWORD)).status_code == 200
        assert agent.get("/metrics").status_code == 401
        with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as plain:
            plain.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            try:
                reply = plain.recv(64)
            except ConnectionResetError:  # the TLS handshake failed
                reply = b""
            assert not reply.startswith(b"HTTP/"), "answered in plain HTTP"


@pytest.mark.e2e
def test_certificates_and_users_rotate_without_a_restart_and_a_bad_file_keeps_the_last_good(
    tmp_path: Path, pki: dict
) -> None:
    ca = pki["ca"][0]
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(pki["server"][0].read_bytes())
    key.write_bytes(pki["server"][1].read_bytes())
    config = {
        "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
        "basic_auth_users": {"alice": _hash(PASSWORD)},
    }
    web = _write(tmp_path / "web.yml", config)
    with _agent(web, ca) as agent:
        first = _served_certificate(agent.port, ca)
        # A certificate renewal rewrites the key and certificate files in place.
        key.write_bytes(pki["server2"][1].read_bytes())
        cert.write_bytes(pki["server2"][0].read_bytes())
        agent.wait_for(
            lambda: _served_certificate(agent.port, ca) != first,
            what="the renewed certificate served",
        )
        config["basic_auth_users"] = {"bob": _hash("new password")}
        _write(web, config)
        agent.wait_for(
            lambda: agent.get("/metrics", auth=("bob", "new password")).status_code == 200,
            what="the new user admitted",
        )
        assert agent.get("/metrics", auth=("alice", PASSWORD)).status_code == 401
        web.write_text("tls_server_config: [not, a, mapping")
        time.sleep(0.2)
        assert agent.get("/metrics", auth=("bob", "new password")).status_code == 200
        agent.wait_for(lambda: "not reloaded" in agent.output(), what="the refused file logged")
        logged = agent.output().count("not reloaded")
        for _ in range(5):
            assert agent.get("/metrics", auth=("bob", "new password")).status_code == 200
        assert agent.output().count("not reloaded") == logged, (
            "a refused file is logged once, not per request"
        )


@pytest.mark.e2e
def test_certificate_files_named_before_they_exist_are_served_once_they_do(
    tmp_path: Path, pki: dict
) -> None:
    ca = pki["ca"][0]
    web = _write(tmp_path / "web.yml", _tls(pki))
    with _agent(web, ca) as agent:
        first = _served_certificate(agent.port, ca)
        cert, key = tmp_path / "new.crt", tmp_path / "new.key"
        _write(web, {"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}})
        agent.wait_for(  # the web config is looked at on each new connection
            lambda: (
                _served_certificate(agent.port, ca) == first and "not reloaded" in agent.output()
            ),
            what="the missing files logged, the last good pair served",
        )
        key.write_bytes(pki["server2"][1].read_bytes())
        cert.write_bytes(pki["server2"][0].read_bytes())
        agent.wait_for(
            lambda: _served_certificate(agent.port, ca) != first, what="the new pair served"
        )
        assert agent.output().count("not reloaded") == 1, "one line for one reason"


@pytest.mark.e2e
def test_web_config_errors_name_the_key(tmp_path: Path, pki: dict) -> None:
    cases = {
        "unknown key": (
            {"tls_server_config": {"cert_file": "x", "key_file": "y", "cipher_suites": []}},
            "cipher_suites",
        ),
        "unknown top key": ({"basic_auth": {}}, "basic_auth"),
        "unverified client auth": (
            _tls(pki, client_auth_type="RequireAnyClientCert", client_ca_file=str(pki["ca"][0])),
            "client_auth_type",
        ),
        "client auth without CA": (
            _tls(pki, client_auth_type="RequireAndVerifyClientCert"),
            "client_ca_file",
        ),
        "bad version": (_tls(pki, min_version="TLS14"), "min_version"),
        "versions crossed": (_tls(pki, min_version="TLS13", max_version="TLS12"), "max_version"),
        "allowed names without a CA": (
            _tls(pki, client_allowed_sans=["scraper"]),
            "client_allowed_sans",
        ),
        "plain password": ({"basic_auth_users": {"alice": "hunter2"}}, "basic_auth_users.alice"),
        "bcrypt cost out of range": (
            {"basic_auth_users": {"alice": "$2y$99$" + _hash(PASSWORD)[7:]}},
            "basic_auth_users.alice",
        ),
        "salt bcrypt refuses": (
            {"basic_auth_users": {"alice": "$2b$10$" + "z" * 53}},
            "basic_auth_users.alice",
        ),
        "missing key file": (
            {"tls_server_config": {"cert_file": str(pki["server"][0])}},
            "key_file",
        ),
        "mismatched key": (
            {
                "tls_server_config": {
                    "cert_file": str(pki["server"][0]),
                    "key_file": str(pki["scraper"][1]),
                }
            },
            "key_file",
        ),
        "not a mapping": (["a"], "mapping"),
    }
    for name, (data, named) in cases.items():
        path = _write(tmp_path / "web.yml", data)
        with pytest.raises(WebConfigError, match=named):
            read(str(path))
        run = subprocess.run(
            [
                KEPLER_BRIDGE,
                "collect",
                "--json",
                "--sources",
                "simulated",
                "--simulate",
                "1",
                "--web.config.file",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2, (name, run.stderr)
        assert len(run.stderr.strip().splitlines()) == 1 and "web_config_file" in run.stderr, (
            name,
            run.stderr,
        )


def test_a_key_given_twice_is_refused_not_overridden(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  alice: '{_hash(PASSWORD)}'\nbasic_auth_users: {{}}\n")
    with pytest.raises(WebConfigError, match="key 'basic_auth_users' given twice"):
        read(str(path))
    path.write_text("a: &users {alice: x}\nbasic_auth_users:\n  <<: *users\n  alice: y\n")
    # a key merged in may be overridden: the read goes on, to the unknown key
    with pytest.raises(WebConfigError, match="unsupported key 'a'"):
        read(str(path))


@pytest.mark.e2e
def test_web_config_and_tls_flags_together_are_refused(tmp_path: Path, pki: dict) -> None:
    path = _write(tmp_path / "web.yml", _tls(pki))
    cert, key = pki["server"]
    run = subprocess.run(
        [
            KEPLER_BRIDGE,
            "collect",
            "--json",
            "--sources",
            "simulated",
            "--simulate",
            "1",
            "--web.config.file",
            str(path),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "keep one of the two" in run.stderr, run.stderr


def test_password_check_runs_bcrypt_once_per_user_and_password() -> None:
    users = {"alice": _hash(PASSWORD).encode()}
    check = PasswordCheck()
    assert [check.check(users, "alice", PASSWORD.encode()) for _ in range(5)] == [True] * 5
    assert [check.check(users, "alice", b"wrong") for _ in range(3)] == [False] * 3
    assert check.verifications == 2  # one bcrypt run for the right password, one for the wrong
    # bob does not exist: checked against a stand-in hash, the same work as a wrong password
    assert [check.check(users, "bob", PASSWORD.encode()) for _ in range(3)] == [False] * 3
    assert check.verifications == 3
    users["alice"] = _hash("rotated").encode()
    assert check.check(users, "alice", PASSWORD.encode()) is False
    assert (
        check.verifications == 4
    )  # a new hash is a new cache key: the rotated user is checked again
