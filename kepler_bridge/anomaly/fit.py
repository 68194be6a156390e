"""The short-lived child that fits the IsolationForests: `python -I fit.py` reads a line of JSON,
{"seed": N, "devices": [[uuid, rows, width], ...]}, then each device's rows as doubles, on stdin;
it prints a line of JSON, {"devices": [[uuid, samples, [nodes of each tree, ...]], ...]}, then each
tree's node arrays (TYPECODES) as raw bytes.

The trees are grown as scikit-learn's IsolationForest grows them (each on `samples` rows drawn
without replacement, split on a random feature that varies among the node's rows at a threshold
drawn uniformly over their range, to a depth of log2(samples)), in plain Python: a fit of 8 devices
takes a fraction of a second, where importing scikit-learn, numpy and scipy alone took 1.4 s of CPU
and 100 MiB. Raw arrays, not JSON numbers, cross the pipe: the worker parsing 5 MB of JSON trees
held the GIL for 150 ms, and every scrape meanwhile waited.
"""

from __future__ import annotations

import json
import math
import random
import sys
from array import array
from typing import Any, Mapping, Sequence

TREES = 50
MAX_SAMPLES = 256
# Per tree: left, right, feature (node indices; a leaf points at itself) and threshold, length, low,
# high (doubles): arrays, not lists of Python numbers, 44 bytes a node where the worker keeps them.
TYPECODES = "iiidddd"
EULER_GAMMA = 0.5772156649015329

Tree = list[array]


def fit(rows: Sequence[Sequence[float]], seed: int) -> dict[str, Any]:
    """One device's forest from its rows: per tree its node arrays (TYPECODES order), and the
    number of rows each tree was grown on."""
    draw = random.Random(seed)
    columns = [array("d", column) for column in zip(*rows)]
    samples = min(MAX_SAMPLES, len(rows))
    depth = math.ceil(math.log2(max(samples, 2)))
    trees = [
        _grow(columns, draw.sample(range(len(rows)), samples), depth, draw) for _ in range(TREES)
    ]
    return {"samples": samples, "trees": trees}


def _grow(columns: list[array], rows: list[int], most_depth: int, draw: random.Random) -> Tree:
    """A tree grown on `rows` (indices into `columns`), its nodes numbered parent first. `length`
    is a leaf's depth plus the expected depth of its rows, an inner node's depth plus one: the path
    of a point that falls outside the range [low, high] its rows spanned on the node's feature,
    which a split drawn over that wider range would isolate there."""
    tree = [array(code) for code in TYPECODES]
    left, right = tree[0], tree[1]
    todo = [(rows, 0, -1, left)]  # a node's rows, depth, parent, and the parent's link to it
    while todo:
        held, depth, parent, link = todo.pop()
        node = len(left)
        if parent >= 0:
            link[parent] = node
        split = _split(columns, held, draw) if depth < most_depth and len(held) > 1 else None
        if split is None:
            _add(tree, node, node, 0, math.inf, depth + path_length(len(held)), -math.inf, math.inf)
            continue
        feature, values, low, high = split
        threshold = draw.uniform(low, high)
        if threshold >= high:  # uniform() may give the upper end: every row would go left
            threshold = low
        _add(tree, -1, -1, feature, threshold, depth + 1.0, low, high)
        todo.append(([i for i, v in zip(held, values) if v > threshold], depth + 1, node, right))
        todo.append(([i for i, v in zip(held, values) if v <= threshold], depth + 1, node, left))
    return tree


def _split(
    columns: list[array], rows: list[int], draw: random.Random
) -> tuple[int, list[float], float, float] | None:
    """A feature drawn at random among those that vary among `rows`, their values of it, its
    lowest and highest; None where every feature is constant among them."""
    for feature in draw.sample(range(len(columns)), len(columns)):
        column = columns[feature]
        values = [column[i] for i in rows]
        low, high = min(values), max(values)
        if high > low:
            return feature, values, low, high
    return None


def _add(tree: Tree, *node: float) -> None:
    for column, value in zip(tree, node):
        column.append(value)


def path_length(n: float) -> float:
    """The mean depth of an unsuccessful search in a binary search tree of n rows."""
    if n <= 1:
        return 0.0
    if n == 2:
        return 1.0
    return 2.0 * (math.log(n - 1.0) + EULER_GAMMA) - 2.0 * (n - 1.0) / n


def encode(answer: Mapping[str, Mapping[str, Any]]) -> bytes:
    """The fitted forests of `answer` (uuid: what `fit` gives) as this child prints them."""
    header = [[uuid, f["samples"], [len(t[0]) for t in f["trees"]]] for uuid, f in answer.items()]
    arrays = (column.tobytes() for f in answer.values() for t in f["trees"] for column in t)
    return json.dumps({"devices": header}).encode() + b"\n" + b"".join(arrays)


def main() -> int:
    head, _, body = sys.stdin.buffer.read().partition(b"\n")
    request = json.loads(head)
    seed, at, answer = int(request["seed"]), 0, {}
    values = array("d")
    if len(body) != sum(rows * width for _, rows, width in request["devices"]) * values.itemsize:
        raise ValueError(f"{len(body)} bytes of rows are not the rows the request announces")
    values.frombytes(body)
    for uuid, rows, width in request["devices"]:
        data = values[at : at + rows * width]
        at += rows * width
        answer[uuid] = fit([data[i : i + width] for i in range(0, len(data), width)], seed)
    sys.stdout.buffer.write(encode(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
