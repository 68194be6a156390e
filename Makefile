# `make run` and `make test` work on a fresh Debian bookworm machine (root installs system packages).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PEERS_VENV := .venv-peers
LISTEN ?= 0.0.0.0:30060
SIMULATE ?= 0
IS_ROOT := $(shell [ "$$(id -u)" -eq 0 ] && echo yes)

.PHONY: run test test-fast lint deps deps-run deps-test bench clean gpu-check gpu-check-bundle

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python setup.cfg setup.py
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

# eBPF needs bcc and kernel headers; without root the agent falls back to procfs.
deps-run: $(VENV)/.installed
ifeq ($(IS_ROOT),yes)
	bash scripts/prepare-bpf-host.sh
endif

deps-test: deps-run
	bash scripts/apt-install.sh gcc prometheus prometheus-alertmanager victoria-metrics chromium podman runc debootstrap docker-registry gnupg qemu-user-static binfmt-support
ifeq ($(IS_ROOT),yes)
	bash scripts/prepare-binfmt.sh
endif

deps: deps-test

run: deps-run
	$(BIN)/kepler-bridge serve --listen $(LISTEN) --simulate $(SIMULATE)

test: deps-test lint
	$(BIN)/python -m pytest -q -rs

# The inner loop: all but the tests that start the agent or a server (marker e2e, tests/README.md).
test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q -rs -m "not e2e"

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The peers of benchmarks/peers.py: nvitop-exporter in a venv of its own, node_exporter from Debian.
NVITOP_EXPORTER ?= 1.7.2
$(PEERS_VENV)/.installed:
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q nvitop-exporter==$(NVITOP_EXPORTER)
	touch $@

bench: deps-test $(PEERS_VENV)/.installed
	bash scripts/apt-install.sh wrk prometheus-node-exporter
	$(BIN)/python benchmarks/agent_http.py
	$(BIN)/python benchmarks/slow_clients.py
	$(BIN)/python benchmarks/pipelined_clients.py
	$(BIN)/python benchmarks/bpf_overhead.py
	$(BIN)/python benchmarks/state_save.py
	$(BIN)/python benchmarks/sample_cost.py --sources nvml,ebpf --worker-gc --pace 0.05 --samples 20 --blocks 3
	$(BIN)/python benchmarks/device_churn.py
	$(BIN)/python benchmarks/source_reads.py
	$(BIN)/python benchmarks/source_reads.py --sources ebpf,procfs --extra 3000
	$(BIN)/python benchmarks/scrape_phase.py
	$(BIN)/python benchmarks/first_scrape.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/remote_write_bytes.py
	$(BIN)/python benchmarks/fleet.py
	$(BIN)/pip install -q py-spy
	$(BIN)/python benchmarks/thread_cpu.py
	$(BIN)/python benchmarks/peers.py

# On a machine with an NVIDIA GPU: kepler-bridge against nvidia-smi, read-only (README "Check on a
# real GPU"). It needs no venv: $(PYTHON) with the wheels of dist/gpu-check, built where PyPI is
# reachable by gpu-check-bundle (carry that folder to the GPU machine: it runs on its own too).
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu-check.sh

gpu-check-bundle: $(VENV)/.installed
	PYTHON=$(BIN)/python bash scripts/gpu-check-bundle.sh dist/gpu-check

clean:
	rm -rf $(VENV) $(PEERS_VENV) build *.egg-info .pytest_cache
