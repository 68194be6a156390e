"""The IsolationForest of one device: fitted in a short-lived child (fit.py), scored here in plain
Python: as scikit-learn scores the rows it saw, and higher than it does for a sample beyond the
range a node's rows spanned.

Scoring one sample walks 50 trees of at most 8 levels, about 0.1 ms, where scikit-learn's
`score_samples` costs milliseconds a call and its import 100 MiB of the worker's memory.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
from array import array
from itertools import chain
from typing import IO, Mapping, Sequence

from kepler_bridge.anomaly import fit
from kepler_bridge.turns import normal_children

MIN_ROWS = 30  # fewer rows make no model
FIT_TIMEOUT = 120.0

# Per tree: left, right, feature (node indices) and threshold, length, low, high (doubles).
Tree = tuple[array, array, array, array, array, array, array]
NODE_BYTES = sum(array(code).itemsize for code in fit.TYPECODES)


class Forest:
    """A fitted forest: per tree the node arrays the child printed."""

    def __init__(self, trees: list[Tree], samples: int, fitted_at: float) -> None:
        self.trees = trees
        self.norm = fit.path_length(float(samples))
        self.fitted_at = fitted_at

    def score(self, vector: Sequence[float]) -> float:
        """2^(-mean isolation depth / expected depth): near 1 for a sample isolated at once,
        about 0.5 and below for ordinary ones."""
        total = 0.0
        for tree in self.trees:
            total += _path(tree, vector)
        mean = total / max(len(self.trees), 1)
        return math.pow(2.0, -mean / self.norm) if self.norm > 0 else 0.5


def read_forests(printed: IO[bytes], fitted_at: float) -> dict[str, Forest]:
    """The forests the child prints (fit.py), by device, read a tree at a time: never one buffer
    of megabytes, whose first touch of fresh pages held the GIL for milliseconds. RuntimeError
    where the arrays are not as many bytes as the first line announces."""
    devices = json.loads(printed.readline())["devices"]
    forests = {}
    for uuid, samples, nodes in devices:
        forests[uuid] = Forest([_read_tree(printed, n) for n in nodes], int(samples), fitted_at)
    if printed.read(1):
        raise RuntimeError("the model fit printed more bytes of trees than it announced")
    return forests


def _read_tree(printed: IO[bytes], nodes: int) -> Tree:
    if not isinstance(nodes, int) or nodes < 1:
        raise RuntimeError(f"the model fit announced a tree of {nodes!r} nodes")
    columns = [array(code) for code in fit.TYPECODES]
    for column in columns:
        data = printed.read(nodes * column.itemsize)
        if len(data) != nodes * column.itemsize:
            raise RuntimeError("the model fit printed fewer bytes of trees than it announced")
        column.frombytes(data)
    left, right, feature, threshold, length, low, high = columns
    return left, right, feature, threshold, length, low, high


def request(rows: Mapping[str, Sequence[Sequence[float]]], seed: int) -> bytes:
    """What the child reads (fit.py): every row of a device as wide as its first."""
    devices = [(uuid, len(v), len(v[0]) if v else 0) for uuid, v in rows.items()]
    data = [array("d", chain.from_iterable(v)) for v in rows.values()]
    for (uuid, count, width), values in zip(devices, data):
        if len(values) != count * width:
            raise ValueError(f"the rows of {uuid} are not all {width} values wide")
    head = json.dumps({"seed": seed, "devices": devices}).encode()
    return head + b"\n" + b"".join(values.tobytes() for values in data)


def _path(tree: Tree, vector: Sequence[float]) -> float:
    """The expected isolation depth of `vector` in one tree. Beyond the range a node's rows spanned
    on its feature, a split drawn over the range widened to the sample isolates it there with the
    chance excess / widened range (scikit-learn gives it the depth of the rows at the edge)."""
    left, right, feature, threshold, length, low, high = tree
    total, weight, node, child = 0.0, 1.0, 0, left[0]
    while child != node:  # each item read once: an array makes a new number at every read
        value = vector[feature[node]]
        lo, hi = low[node], high[node]
        if value < lo or value > hi:
            excess = lo - value if value < lo else value - hi
            chance = excess / (hi - lo + excess)
            total += weight * chance * length[node]
            weight *= 1.0 - chance
        node = child if value <= threshold[node] else right[node]
        child = left[node]
    return total + weight * length[node]


def fit_all(
    rows: Mapping[str, Sequence[Sequence[float]]], seed: int, now: float
) -> dict[str, Forest]:
    """A forest per device from its rows, fitted in one child process; raises RuntimeError with
    the child's reason where it fails or takes longer than FIT_TIMEOUT."""
    asked = request(rows, seed)
    env = {"PATH": os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as errors:
        try:
            with normal_children():  # the fit thread inherits SCHED_IDLE from the anomaly thread
                child = subprocess.Popen(
                    [sys.executable, "-I", fit.__file__],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    env=env,
                )
        except OSError as err:
            raise RuntimeError(f"the model fit did not start: {err}") from err
        timer = threading.Timer(FIT_TIMEOUT, child.kill)
        timer.start()
        try:
            return _answer(child, asked, now, errors)
        finally:
            timer.cancel()
            child.kill()  # a no-op where it has exited; reaped by wait
            child.wait()


def _answer(
    child: subprocess.Popen, asked: bytes, now: float, errors: IO[bytes]
) -> dict[str, Forest]:
    """The forests `child` prints for `asked`, or RuntimeError with its reason."""
    assert child.stdin is not None and child.stdout is not None
    try:
        with child.stdin:
            child.stdin.write(asked)
        with child.stdout:
            forests = read_forests(child.stdout, now)
    except (OSError, ValueError, RuntimeError) as err:
        problem: Exception | None = err
    else:
        problem = None
    status = child.wait()
    if status < 0:
        raise RuntimeError(
            f"the model fit did not finish within {FIT_TIMEOUT:.0f} s (signal {-status})"
        )
    if status != 0:
        errors.seek(0)
        reason = errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"the model fit failed: {reason[0][:300]}")
    if problem is not None:
        raise RuntimeError(f"the model fit printed no forests: {problem}") from problem
    return forests
