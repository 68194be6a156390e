"""Counter state carried from a crashed worker to the next one within one agent run.

The gunicorn master makes a private directory (mode 0700, on tmpfs where
/dev/shm exists) and removes it when it exits; the worker's sampler writes
its state there after every sample and a new worker reads it back, so
counters continue instead of restarting from zero.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import tempfile

log = logging.getLogger(__name__)

FILE = "sampler-state.pickle"
# tmpfs first: the state is rewritten every sample and must not outlive the agent.
PLACES = ("/dev/shm", None)


def make_dir() -> str:
    """A new private directory for the state, named after the master's pid.

    '' (with a warning) where none can be made."""
    problems = []
    for place in PLACES:
        try:
            return tempfile.mkdtemp(prefix=f"kepler-bridge-{os.getpid()}-", dir=place)
        except OSError as err:
            problems.append(f"{place or tempfile.gettempdir()}: {err.strerror or err}")
    log.warning(
        "no directory for counter state (%s): counters restart from zero if the worker restarts; "
        "make /dev/shm or $TMPDIR writable",
        "; ".join(problems),
    )
    return ""


def remove_dir(directory: str) -> None:
    """Delete the state directory and what it holds."""
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def save(directory: str, state: object) -> None:
    """Replace the saved state atomically: a reader sees the old or the new file, never a part."""
    path = os.path.join(directory, FILE)
    partial = f"{path}.{os.getpid()}"
    with open(partial, "wb") as file:
        pickle.dump(state, file, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)


def load(directory: str) -> object | None:
    """The state the previous worker saved, or None when there is none or it cannot be read."""
    try:
        with open(os.path.join(directory, FILE), "rb") as file:
            # Only this agent's own processes can write here:
            # the master made the directory with mode 0700.
            return pickle.load(file)
    except FileNotFoundError:
        return None
    except (
        Exception
    ) as err:  # e.g. the package was upgraded under the running master and its classes changed
        log.warning(
            "counter state in %s unreadable, counters restart from zero: %s", directory, err
        )
        return None
