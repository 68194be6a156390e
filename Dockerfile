# kepler-bridge DaemonSet image: Debian bookworm's python3 and python3-bpfcc, the agent in a venv.
# The same file builds amd64 and arm64, in two variants:
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/kepler-bridge:0.1.0 .
#   docker buildx build --platform linux/amd64,linux/arm64 --target slim -t REGISTRY/kepler-bridge:0.1.0-slim .
# The default (last) target has bcc: CPU time from eBPF, else from /proc. `slim` has no bcc (and so no
# LLVM): CPU time from /proc only, for small edge boards. Sizes are in the README.

# Stage 1: install the package and its PyPI dependencies (wheels for the build platform) into a venv.
FROM debian:bookworm-slim AS build
# Debian's own versions (security updates keep replacing them), so apt packages are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY setup.cfg setup.py README.md ./
COPY kepler_bridge ./kepler_bridge
COPY bpf ./bpf
# --system-site-packages lets the venv import Debian's bcc (python3-bpfcc) in the final stage.
RUN python3 -m venv --system-site-packages /opt/kepler-bridge \
 && /opt/kepler-bridge/bin/pip install --no-cache-dir . \
 && /opt/kepler-bridge/bin/pip uninstall -y pip setuptools

# Stage 2, target `slim`: the runtime only (no pip, no compiler, no bcc).
FROM debian:bookworm-slim AS slim
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kepler-bridge" \
      org.opencontainers.image.description="Accelerator and workload energy metrics for Kubernetes, KubeEdge and baetyl edge nodes (/metrics and /v1/collect on port 30060)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/library/debian:bookworm-slim"
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/kepler-bridge /opt/kepler-bridge
ENV PATH=/opt/kepler-bridge/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
EXPOSE 30060
# Kubernetes uses the pod's probes instead; this serves `docker run` on the default --listen.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:30060/healthz', timeout=4)"]
ENTRYPOINT ["kepler-bridge"]
CMD ["serve"]

# Stage 3, the default target: slim plus bcc, which compiles the eBPF programs with the host's kernel headers.
FROM slim AS full
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-bpfcc \
 && rm -rf /var/lib/apt/lists/*
