"""Write the generated deployment assets (alert rules, dashboards, manifests), or --check they
are current."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
GENERATORS = (
    ROOT / "alerts" / "render.py",
    ROOT / "grafana" / "dashboards.py",
    ROOT / "manifests" / "render.py",
)


def load(path: Path) -> ModuleType:
    """A generator script loaded as a module (its folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rendered() -> dict[Path, str]:
    """Every generated file and the text it must hold."""
    outputs: dict[Path, str] = {}
    for generator in GENERATORS:
        outputs.update(load(generator).rendered())
    return outputs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if a generated file is out of date"
    )
    args = parser.parse_args(argv)
    outputs = rendered()
    stale = [
        path
        for path, text in outputs.items()
        if not path.exists() or path.read_text(encoding="utf-8") != text
    ]
    if args.check:
        for path in stale:
            sys.stderr.write(
                f"{path.relative_to(ROOT)} is out of date: run python scripts/render_assets.py\n"
            )
        return 1 if stale else 0
    for path, text in outputs.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
