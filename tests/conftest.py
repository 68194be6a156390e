"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakenvml import FakeNvml
from fakenvml import build as build_fakenvml


@pytest.fixture(scope="session")
def fakenvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1 (tests/fakenvml), compiled once per session."""
    return build_fakenvml(tmp_path_factory.mktemp("fakenvml"))


@pytest.fixture
def fake_nvml(fakenvml_lib: Path, tmp_path: Path) -> FakeNvml:
    """A fake NVML with 2 GPUs and 2 processes per GPU; merge ``fake_nvml.env()``
    into the environment of the process that loads ``fake_nvml.library``."""
    return FakeNvml(fakenvml_lib, tmp_path / "fakenvml.conf", gpus=2, processes_per_gpu=2)
