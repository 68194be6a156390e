"""Command line: serve, collect, doctor, --version."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any, NoReturn, Sequence

from kepler_bridge import __version__
from kepler_bridge.config import SETTINGS, Config, ConfigError, load
from kepler_bridge.http import preflight
from kepler_bridge.log_format import log_to_stderr
from kepler_bridge.settings_parse import one_line
from kepler_bridge.sources import available, check_names, selected_groups

EXIT_BAD_SETTING = 2


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line and exits 2, like every other bad setting, and
    takes no abbreviation: `--inter` is no `--interval`, nor breaks when a new flag shares it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_BAD_SETTING,
            f"kepler-bridge: bad setting: {one_line(message)}; see {self.prog} --help\n",
        )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kepler-bridge", description="Accelerator and workload energy metrics for one node."
    )
    parser.add_argument("--version", action="version", version=f"kepler-bridge {__version__}")
    # dest is not "command": that is a setting (--command) and would overwrite the subcommand name.
    commands = parser.add_subparsers(dest="subcommand", required=True, parser_class=_Parser)
    _add_setting_flags(
        commands.add_parser("serve", help="run the agent: /metrics and /v1/collect over HTTP")
    )
    collect = commands.add_parser("collect", help="take one sample, print it, exit")
    form = collect.add_mutually_exclusive_group()
    form.add_argument(
        "--json", action="store_const", const="json", dest="form", help="/v1/collect JSON"
    )
    form.add_argument(
        "--prometheus",
        action="store_const",
        const="prometheus",
        dest="form",
        help="Prometheus text (the default)",
    )
    _add_setting_flags(collect)
    _add_setting_flags(
        commands.add_parser("doctor", help="say which sources work here, and why not")
    )
    return parser


def _add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting, plus --config; defaults stay None so precedence works."""
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or JSON config file (env KEPLER_BRIDGE_CONFIG)"
    )
    for setting in SETTINGS:
        parser.add_argument(
            setting.flag,
            *setting.aliases,
            dest=setting.key,
            metavar=setting.key.split("_")[-1].upper(),
            help=f"{setting.help} (env {setting.envs[0]}, default {_show(setting.default)})",
        )


def _show(default: object) -> str:
    """A default as --help shows it."""
    if isinstance(default, tuple):
        return ",".join(default) or "none"
    return str(default) if default != "" else "none"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.subcommand == "serve":
        # Until the master and then its worker handle it, a SIGHUP (a reload) would end them; the
        # worker's first sample reads the settings again, so one ignored now is not lost.
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        config = load(vars(args))
        check_names(config)
        preflight.check(config)
    except ConfigError as err:
        print(f"kepler-bridge: {err}", file=sys.stderr)
        return EXIT_BAD_SETTING
    log_to_stderr()
    if args.subcommand == "serve":
        from kepler_bridge.http.server import serve

        return serve(config, vars(args))
    if args.subcommand == "collect":
        return _collect(config, args.form or "prometheus")
    return _doctor(config)


def _collect(config: Config, form: str) -> int:
    from kepler_bridge.exposition import RENDERERS, RenderSettings
    from kepler_bridge.sampling.sampler import Sampler
    from kepler_bridge.store import SnapshotStore

    sampler = Sampler(config, SnapshotStore())
    try:
        snapshot = sampler.sample()
    finally:
        sampler.stop()
    body = RENDERERS["baetyl" if form == "json" else "text"](snapshot, RenderSettings.of(config))
    sys.stdout.buffer.write(body + b"\n" if form == "json" else body)
    return 0


def _doctor(config: Config) -> int:
    from kepler_bridge.sampling.device_check import check_devices
    from kepler_bridge.sampling.slots import check_source

    groups = selected_groups(config)
    selected = [name for group in groups for name in group]
    names = selected + [
        name for name in available() if name not in selected and name != "simulated"
    ]
    working = 0  # of the selected: what the agent would serve from (/readyz)
    for name in names:
        ok, line = check_source(name, config)
        working += ok and name in selected
        print(f"{'ok ' if ok else 'no '} {name:<10} {line}")
    mark, line = check_devices(config)
    print(f"{mark} {'devices':<10} {line}")
    print(_anomaly_line(config))
    return 0 if working else 1


def _anomaly_line(config: Config) -> str:
    """Whether the anomaly detectors and their IsolationForest run here."""
    if not config.anomaly:
        return "--  anomaly    off (anomaly: false)"
    return "ok  anomaly    named detectors and IsolationForest on"
