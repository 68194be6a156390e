"""docs/design.md states what the code does.

Package layout, import direction, commands, endpoints and who may read them, the
/v1/collect example, the health series and the metric catalogue (names, types, labels).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import typing
import wsgiref.util
from pathlib import Path

from kepler_bridge import cli, model
from kepler_bridge.exposition import baetyl, prometheus
from kepler_bridge.http.app import WebSettings, create_app
from kepler_bridge.model import (
    Anomalies,
    ContainerCpu,
    CpuZoneEnergy,
    DeviceAnomaly,
    Energy,
    GpuProcess,
    GpuReading,
    Holder,
    MigInstance,
    NvLink,
    PodRef,
    ProcessCpu,
    Snapshot,
    SourceStatus,
    WorkloadEnergy,
)
from kepler_bridge.store import SnapshotStore
from scaffold import families, make_config

ROOT = Path(__file__).resolve().parent.parent
DESIGN = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
PACKAGE = ROOT / "kepler_bridge"
# What "device" stands for in the catalogue's label column, besides node.
DEVICE_LABELS = {"gpu", "uuid", "vendor", "model"}
TOP_LEVEL = (
    "kepler_bridge/",
    "tests/",
    "docs/",
    "manifests/",
    "alerts/",
    "grafana/",
    "bpf/",
    "scripts/",
    "examples/",
    "benchmarks/",
)


def section(title: str, subsections: bool = True) -> str:
    """The text under the heading that starts with `title`.

    It runs up to the next heading of the same or a higher level
    (of any level without `subsections`)."""
    match = re.search(rf"^(#+) {re.escape(title)}.*$", DESIGN, re.MULTILINE)
    assert match, f"docs/design.md has no heading {title!r}"
    level = len(match.group(1)) if subsections else 6
    rest = DESIGN[match.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text`, header and separator rows left out."""
    found = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|") or re.fullmatch(r"[|\-: ]+", line):
            continue
        found.append([cell.strip() for cell in line.strip("|").split("|")])
    return found[1:] if found else found  # the first row is the header


def quoted(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def test_layout_lists_every_module_and_nothing_else() -> None:
    listed = {
        path
        for cells in rows(section("Package layout", subsections=False))
        for path in quoted(cells[0])
    }
    actual = {
        path.relative_to(ROOT).as_posix()
        for path in PACKAGE.rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert {path for path in listed if path.endswith(".py")} == actual
    for path in listed:
        assert (ROOT / path).exists(), path


def test_every_repository_path_named_exists() -> None:
    named = {token for token in re.findall(r"`([^`\s]+)`", DESIGN) if token.startswith(TOP_LEVEL)}
    named |= {f"docs/{link}" for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", DESIGN)}
    assert named
    for path in sorted(named):
        assert (ROOT / path).resolve().exists(), (
            f"docs/design.md names {path}, which does not exist"
        )


def _imports(path: Path, module: str) -> set[str]:
    names: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("kepler_bridge")}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix if prefix.endswith(".") else prefix + ".")


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name, packages by their __init__.py."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_table() -> dict[str, set[str]]:
    """docs/design.md's import table: package or module -> what it may import."""
    table = {}
    for cells in rows(section("Import direction")):
        (layer,), allowed = quoted(cells[0]), quoted(cells[1])
        assert layer not in table, f"{layer} has two rows"
        table[layer] = set(allowed)
    return table


def _row(table: dict[str, set[str]], name: str) -> str:
    """The most specific row for a module."""
    return max((layer for layer in table if _under(name, layer)), key=len)


def test_import_table_has_a_row_for_every_package_and_top_level_module() -> None:
    modules = _modules()
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    top_level = {name for name in modules if name.count(".") == 1}
    table = _import_table()
    assert packages | top_level <= set(table), (
        f"no row for {sorted(packages | top_level - set(table))}"
    )
    assert set(table) <= set(modules), f"rows for no module: {sorted(set(table) - set(modules))}"


def test_imports_follow_the_data_flow() -> None:
    table = _import_table()
    for name, path in _modules().items():
        layer = _row(table, name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = {layer} | ({package} if package != "kepler_bridge" else set())
        wrong = sorted(
            imported
            for imported in _imports(path, name)
            if not any(_under(imported, allowed) for allowed in own | table[layer])
            and imported not in ("kepler_bridge", "kepler_bridge.__version__")
        )
        assert not wrong, (
            f"{name} imports {wrong}, against docs/design.md's import direction (row {layer})"
        )


def test_import_table_has_no_cycle() -> None:
    table = _import_table()
    edges = {
        layer: {_row(table, allowed) for allowed in allowed_set} - {layer}
        for layer, allowed_set in table.items()
    }
    done: set[str] = set()

    def visit(layer: str, path: tuple[str, ...]) -> None:
        assert layer not in path, (
            f"docs/design.md's import table has a cycle: {' -> '.join(path + (layer,))}"
        )
        if layer not in done:
            for target in edges[layer]:
                visit(target, path + (layer,))
            done.add(layer)

    for layer in table:
        visit(layer, ())


def test_commands_are_the_subcommands() -> None:
    listed = {
        command.split()[1]
        for cells in rows(section("Command line"))
        for command in quoted(cells[0])
    }
    (subparsers,) = [
        action
        for action in cli._parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ]
    assert listed == set(subparsers.choices)


def test_endpoints_and_who_may_read_them(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    settings = WebSettings.of(make_config(auth_token_file=token, node_name="n1"))
    app = create_app(SnapshotStore(), lambda: settings)
    table = {quoted(cells[0])[0]: cells[-1] for cells in rows(section("HTTP endpoints"))}
    assert set(table) == set(app.routes)
    for path, guarded in table.items():
        assert guarded in ("yes", "no"), path
        assert (_status(app, path) == 401) == (guarded == "yes"), path
        assert _status(app, path, HTTP_AUTHORIZATION="Bearer s3cret") != 401, path
    # No file route: the page template is only served filled in, behind the guard.
    assert _status(app, "/static/index.html") == 404


def _status(app: typing.Callable, path: str, **headers: str) -> int:
    """The status code of a GET of `path` from the WSGI `app`."""
    environ = {"PATH_INFO": path, **headers}
    wsgiref.util.setup_testing_defaults(environ)
    answered: list[str] = []
    b"".join(app(environ, lambda status, headers: answered.append(status)))
    return int(answered[0].split()[0])


def test_collect_example_is_what_the_code_renders() -> None:
    (example,) = re.findall(r"```json\n(.*?)```", section("/v1/collect"), re.DOTALL)
    body = json.loads(example)
    ((node, answer),) = body.items()
    gpus = tuple(
        GpuReading(
            index=i,
            uuid=f"GPU-{i}",
            vendor="nvidia",
            model="A100",
            memory_used_bytes=device["usedMemory"],
            memory_total_bytes=device["totalMemory"],
        )
        for i, device in enumerate(answer["devices"])
    )
    snapshot = Snapshot(
        node=node, timestamp=1.0, duration_seconds=0.01, interval_seconds=1.0, gpus=gpus
    )
    assert json.loads(baetyl.render(snapshot)) == body


def test_health_series_are_the_code_s() -> None:
    (line,) = [line for line in DESIGN.splitlines() if line.startswith("Health series:")]
    assert set(quoted(line)) == prometheus.HEALTH


def _filled(cls: type, **given: object) -> object:
    """An instance with every optional number set, so that each family from it has a series."""
    hints = typing.get_type_hints(cls, vars(model))
    numbers = {
        item.name: 1 if int in typing.get_args(hints[item.name]) else 0.5
        for item in dataclasses.fields(cls)
        if item.name not in given and item.default is None
    }
    return cls(**numbers, **given)


def full_snapshot() -> Snapshot:
    """A snapshot in which every metric family of the catalogue has at least one series."""
    owner = PodRef("ml", "train-0", "main")
    row = WorkloadEnergy(
        pid="7", comm="python3", container_id="c1", owner=owner, cpu_joules=1.0, gpu_joules=1.0
    )
    gpu = _filled(
        GpuReading,
        index=0,
        uuid="GPU-0",
        vendor="nvidia",
        model="A100",
        throttled=(("sw_power_cap", True),),
        xid_errors=((79, 1),),
        processes=(GpuProcess(pid=7, comm="python3", memory_used_bytes=1, utilization=0.5),),
        holders=(Holder("c1", owner),),
        pipe_active=(("tensor_hmma", 0.5),),
        engine_active=(("nvdec", 0.5),),
        nvlinks=(NvLink(0, True, 1, 1, (("replay", 1),)),),
        clock_event_seconds=(("power", 1.0),),
        mig_instances=(
            MigInstance(
                gpu_instance=1,
                compute_instance=0,
                uuid="MIG-0",
                profile="1g.10gb",
                slices=1,
                memory_used_bytes=1,
                memory_total_bytes=2,
                pids=(7,),
                holders=(Holder("c1", owner),),
                sm_active=0.5,
                sm_occupancy=0.5,
                graphics_active=0.5,
                tensor_active=0.5,
                dram_active=0.5,
            ),
        ),
    )
    return Snapshot(
        node="n1",
        timestamp=1.0,
        duration_seconds=0.01,
        interval_seconds=1.0,
        sources=(SourceStatus("nvml", True),),
        gpus=(gpu,),
        processes=(ProcessCpu(7, "python3", 2.0, "c1"),),
        process_cpu_other=1.0,
        containers=(ContainerCpu("c1", 2.0, owner),),
        ebpf_programs_attached=1,
        energy=Energy(
            cpu_zones=(CpuZoneEnergy("package", "rapl", 1.0),),
            gpu_idle=(("GPU-0", 1.0),),
            gpu_unattributed=(("GPU-0", "shared", 1.0),),
            cpu_processes=(row,),
            gpu_processes=(row,),
            containers=(row,),
            pods=(row,),
        ),
        anomalies=Anomalies(
            ("stuck", "unusual"), (DeviceAnomaly("GPU-0", ("stuck",), 0.7, 1.0),), 0.1
        ),
    )


def catalogue() -> dict[str, tuple[str, set[str]]]:
    """docs/design.md's metric table: name -> (type, every label including node)."""
    found: dict[str, tuple[str, set[str]]] = {}
    for cells in rows(section("Metrics")):
        name, kind, labels = quoted(cells[0])[0], cells[1], cells[2]
        assert name not in found, f"{name} is listed twice"
        words = set(re.sub(r"`[^`]*`", "", labels).replace(",", " ").split())
        assert words <= {"device"}, (
            f"{name}: labels column may hold backticked labels and 'device' only"
        )
        found[name] = (
            kind,
            {"node", *quoted(labels), *(DEVICE_LABELS if "device" in words else ())},
        )
    return found


def test_metric_catalogue_lists_exactly_the_metrics_the_code_can_emit() -> None:
    assert set(catalogue()) == set(prometheus.METRICS)


def test_metric_catalogue_types_and_labels_are_what_a_scrape_shows() -> None:
    text = prometheus.render(full_snapshot(), lambda name: True).decode()
    seen: dict[str, tuple[str, set[str]]] = {}
    for family in families(text).values():
        name = prometheus.exposed_name(family)
        if name in prometheus.METRICS:
            seen[name] = (
                family.type,
                {label for sample in family.samples for label in sample.labels},
            )
    missing = set(prometheus.METRICS) - set(seen)
    assert not missing, f"full_snapshot() yields no series of {missing}: extend it"
    documented = catalogue()
    for name, (kind, labels) in seen.items():
        assert documented[name] == (kind, labels), name


MAX_FUNCTION_LINES = 40
MAX_MODULE_LINES = 400


def test_no_function_over_40_lines_and_no_module_over_400() -> None:
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        name = path.relative_to(ROOT).as_posix()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(f"{name}:{node.lineno} {node.name}(): {lines} lines")
    assert not too_long, "split these (see the how-we-write-code rules): " + "; ".join(too_long)
