"""Pod lists of this node from the kubelet, the API server or KubeEdge's edge MetaServer, over
HTTP(S)."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import quote

from kepler_bridge.config import Config
from kepler_bridge.kube.pods import containers_of
from kepler_bridge.model import PodRef


class KubeError(Exception):
    """An endpoint could not be read; the message says which, why, and what to change."""


@dataclass(frozen=True)
class Endpoint:
    """One place that lists this node's pods."""

    name: str  # kubelet, apiserver or metaserver
    url: str


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def endpoints(config: Config, environ: Mapping[str, str]) -> list[Endpoint]:
    """The endpoints kube_source asks for, in the order auto tries them.

    auto: the MetaServer (an edge node keeps its pods there while offline from
    the cloud), then, when a service-account token is mounted, the kubelet and
    the API server.
    """
    if config.kube_source == "off":
        return []
    kubelet_url = (
        config.kubelet_url or f"https://{_host(environ.get('NODE_IP') or '127.0.0.1')}:10250"
    )
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    selector = quote(f"spec.nodeName={config.node_name}", safe="")
    apiserver_url = (
        (
            f"https://{_host(host)}:{environ.get('KUBERNETES_SERVICE_PORT') or '443'}"
            f"/api/v1/pods?fieldSelector={selector}"
        )
        if host
        else ""
    )
    found = [
        Endpoint("metaserver", f"{config.metaserver_url}/api/v1/pods"),
        Endpoint("kubelet", f"{kubelet_url}/pods"),
        Endpoint("apiserver", apiserver_url),
    ]
    if config.kube_source != "auto":
        return [endpoint for endpoint in found if endpoint.name == config.kube_source]
    in_cluster = os.path.isfile(config.kube_token_file)
    return [
        endpoint
        for endpoint in found
        if endpoint.name == "metaserver" or (in_cluster and endpoint.url)
    ]


def _tls(config: Config) -> ssl.SSLContext:
    if config.kube_insecure_skip_tls_verify:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context
    return ssl.create_default_context(
        cafile=config.kube_ca_file if os.path.isfile(config.kube_ca_file) else None
    )


def fetch_pods(endpoint: Endpoint, config: Config, timeout: float) -> dict[str, PodRef]:
    """Container id -> container for the endpoint's pods; KubeError says why not."""
    if not endpoint.url:
        raise KubeError(
            f"{endpoint.name}: KUBERNETES_SERVICE_HOST is not set (the agent runs outside a pod): "
            "run it in a pod, or set kube_source to kubelet or metaserver"
        )
    request, handlers = _request(endpoint, config)
    try:
        with urllib.request.build_opener(*handlers).open(request, timeout=timeout) as response:
            return containers_of(json.load(response))
    except urllib.error.HTTPError as err:
        raise KubeError(
            f"{endpoint.name} {endpoint.url} answered {err.code} {err.reason}: "
            f"{_advice(endpoint, err.code, config)}"
        ) from None
    except urllib.error.URLError as err:
        raise _unreachable(endpoint, err.reason, config) from None
    except (OSError, ValueError, RecursionError, http.client.HTTPException) as err:
        # A broken or hostile answer.
        raise KubeError(f"{endpoint.name} {endpoint.url}: {err}") from None


def _request(
    endpoint: Endpoint, config: Config
) -> tuple[urllib.request.Request, list[urllib.request.BaseHandler]]:
    """The endpoint's request and the handlers to open it with: the token and TLS over HTTPS."""
    request = urllib.request.Request(endpoint.url, headers={"Accept": "application/json"})
    # Proxies from the environment never apply: every endpoint is on this node or in the cluster.
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if endpoint.url.startswith("https:"):
        # The token is a credential: it only travels encrypted. Bound tokens rotate, so it is read
        # each time.
        try:
            with open(config.kube_token_file, encoding="utf-8") as file:
                request.add_header("Authorization", f"Bearer {file.read().strip()}")
        except OSError:
            pass
        handlers.append(urllib.request.HTTPSHandler(context=_tls(config)))
    return request, handlers


def _unreachable(endpoint: Endpoint, reason: str | BaseException, config: Config) -> KubeError:
    """Why the endpoint could not be reached, and what to set."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return KubeError(
            f"{endpoint.name} {endpoint.url}: its certificate is not trusted "
            f"({reason.verify_message}): set kube_ca_file to the CA that signed it, or "
            "kube_insecure_skip_tls_verify=true (kubelets often serve a self-signed "
            "certificate)"
        )
    return KubeError(f"{endpoint.name} {endpoint.url}: {reason}; {_advice(endpoint, 0, config)}")


def _advice(endpoint: Endpoint, status: int, config: Config) -> str:
    if status == 401:
        return (
            f"the token in {config.kube_token_file} was refused; "
            "mount the service account's token there"
        )
    if status == 403:
        return (
            "the agent's service account may not read pods: grant it get on nodes/proxy "
            "(kubelet) or list on pods (API server)"
        )
    if status:
        return "check the endpoint's logs"
    return {
        "kubelet": "set kubelet_url (or NODE_IP from status.hostIP) to the kubelet's address",
        "apiserver": "check KUBERNETES_SERVICE_HOST and the network policy",
        "metaserver": "enable metaServer in edgecore.yaml and run the agent with hostNetwork",
    }[endpoint.name]
