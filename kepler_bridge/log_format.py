"""How the agent's log lines look, in every process that logs through `logging`."""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """INFO and above to stderr, in FORMAT."""
    logging.basicConfig(level=logging.INFO, format=FORMAT)
