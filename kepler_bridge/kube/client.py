"""Pod lists of this node from the kubelet, the API server or KubeEdge's edge MetaServer, over
HTTP(S)."""

from __future__ import annotations

import http.client
import os
import ssl
from dataclasses import dataclass
from typing import Mapping, NamedTuple
from urllib.parse import quote

from kepler_bridge.config import Config
from kepler_bridge.kube import bounded_get
from kepler_bridge.kube.pods import containers_of, finished_pods, read_pod_list
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
            f"/api/v1/pods?fieldSelector={selector}&resourceVersion=0"
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


class Pods(NamedTuple):
    """An endpoint's pod list: container id -> container, and the pods that finished."""

    containers: dict[str, PodRef]
    finished: frozenset[tuple[str, str]]


def fetch_pods(endpoint: Endpoint, config: Config) -> Pods:
    """The endpoint's pods; KubeError says why not."""
    if not endpoint.url:
        raise KubeError(
            f"{endpoint.name}: KUBERNETES_SERVICE_HOST is not set (the agent runs outside a pod): "
            "run it in a pod, or set kube_source to kubelet or metaserver"
        )
    where = f"{endpoint.name} {endpoint.url}"
    try:
        reply = bounded_get.get(
            endpoint.url,
            _headers(endpoint, config),
            _tls(config) if endpoint.url.startswith("https:") else None,
            config.kube_timeout,
            config.kube_max_reply_bytes,
        )
    except bounded_get.ReplyTooLarge:
        raise KubeError(f"{where}: {too_large(config.kube_max_reply_bytes)}") from None
    except TimeoutError:
        raise KubeError(f"{where}: {too_slow(config.kube_timeout, endpoint.name)}") from None
    except OSError as err:
        raise _unreachable(endpoint, err, config) from None
    except http.client.HTTPException as err:  # a broken or hostile answer
        raise KubeError(f"{where}: {err}") from None
    if not 200 <= reply.status < 300:
        raise KubeError(
            f"{where} answered {reply.status} {reply.reason}: "
            f"{_advice(endpoint, reply.status, config)}"
        )
    try:
        pod_list = read_pod_list(reply.body, config.kube_max_reply_bytes)
        return Pods(containers_of(pod_list), finished_pods(pod_list))
    except (ValueError, RecursionError) as err:  # a broken or hostile answer
        raise KubeError(f"{where}: {err}") from None


def too_large(max_bytes: int) -> str:
    """Why a reply over kube_max_reply_bytes was refused, and what to change."""
    return (
        f"its reply is over kube_max_reply_bytes ({max_bytes} bytes) and was not read further; "
        "raise kube_max_reply_bytes if this node's list is that large"
    )


def too_slow(timeout: float, name: str) -> str:
    """Why a request past kube_timeout was cut, and what to change."""
    return (
        f"no whole reply within kube_timeout ({timeout:g} s), cut; raise kube_timeout if the "
        f"{name} is that slow"
    )


def _headers(endpoint: Endpoint, config: Config) -> dict[str, str]:
    """Accept JSON; over HTTPS also the service-account token."""
    headers = {"Accept": "application/json"}
    if endpoint.url.startswith("https:"):
        # The token is a credential: it only travels encrypted. Bound tokens rotate, so it is read
        # each time.
        try:
            with open(config.kube_token_file, encoding="utf-8") as file:
                headers["Authorization"] = f"Bearer {file.read().strip()}"
        except OSError:
            pass
    return headers


def _unreachable(endpoint: Endpoint, reason: OSError, config: Config) -> KubeError:
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
