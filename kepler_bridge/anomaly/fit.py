"""The short-lived child that fits the IsolationForests: `python -I fit.py` reads a line of JSON,
{"seed": N, "devices": [[uuid, rows, width], ...]}, then each device's rows as doubles, on stdin;
it prints a line of JSON, {"devices": [[uuid, samples, [nodes of each tree, ...]], ...]}, then each
tree's node arrays (`forest.TYPECODES`) as raw bytes.

scikit-learn, numpy and scipy cost the process that imports them about 100 MiB; in this child
they are gone when it exits. Raw arrays, not JSON numbers, cross the pipe: the worker parsing 5 MB
of JSON trees held the GIL for 150 ms, and every scrape meanwhile waited.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Mapping

TREES = 50
MAX_SAMPLES = 256
# The dtypes of forest.TYPECODES ("iiidddd": C ints, then doubles), in the machine's byte order.
DTYPES = ("intc", "intc", "intc", "float64", "float64", "float64", "float64")


def fit(rows: Any, seed: int) -> dict[str, Any]:
    """One device's forest from its rows (a sequence of rows or a 2-D array): per tree its node
    arrays (left, right, feature, threshold, length, low, high), a leaf pointing at itself, and the
    number of rows each tree was grown on."""
    import numpy as np
    from sklearn.ensemble import IsolationForest

    data = np.asarray(rows, dtype=float)
    samples = min(MAX_SAMPLES, len(data))
    model = IsolationForest(n_estimators=TREES, max_samples=samples, random_state=seed).fit(data)
    grown = zip(model.estimators_, model.estimators_features_, model.estimators_samples_)
    trees = [_tree(e.tree_, data[np.ix_(s, f)], f) for e, f, s in grown]
    return {"samples": samples, "trees": trees}


def _tree(tree: Any, grown_on: Any, features: Any) -> list[Any]:
    """A tree's node arrays. `length` is a leaf's depth plus the expected depth of its rows, an
    inner node's depth plus one: the path of a point that falls outside the range [low, high] its
    rows spanned on the node's feature, which a split drawn over that wider range would isolate
    there."""
    import numpy as np

    count = tree.node_count
    nodes = np.arange(count)
    leaf = tree.children_left[:count] < 0
    depth = np.zeros(count)
    for node in range(count):  # sklearn numbers a parent before its children
        if not leaf[node]:
            depth[tree.children_left[node]] = depth[tree.children_right[node]] = depth[node] + 1
    split = np.maximum(tree.feature[:count], 0)
    reached = tree.decision_path(grown_on.astype(np.float32)).toarray().astype(bool)
    values = grown_on[:, split]
    low = np.where(reached, values, np.inf).min(axis=0)
    high = np.where(reached, values, -np.inf).max(axis=0)
    columns = (
        np.where(leaf, nodes, tree.children_left[:count]),
        np.where(leaf, nodes, tree.children_right[:count]),
        np.where(leaf, 0, np.asarray(features)[split]),
        np.where(leaf, np.inf, tree.threshold[:count]),
        np.where(leaf, depth + _path_length(tree.n_node_samples[:count]), depth + 1),
        np.where(leaf, -np.inf, low),
        np.where(leaf, np.inf, high),
    )
    return [np.ascontiguousarray(c, dtype=d) for c, d in zip(columns, DTYPES, strict=True)]


def _path_length(n: Any) -> Any:
    """The mean depth of an unsuccessful search in a binary search tree of n rows."""
    import numpy as np

    n = np.asarray(n, dtype=float)
    deep = 2.0 * (np.log(np.maximum(n - 1.0, 1.0)) + 0.5772156649015329) - 2.0 * (n - 1.0) / n
    return np.where(n > 2, deep, np.where(n == 2, 1.0, 0.0))


def encode(answer: Mapping[str, Mapping[str, Any]]) -> bytes:
    """The fitted forests of `answer` (uuid: what `fit` gives) as this child prints them."""
    header = [[uuid, f["samples"], [len(t[0]) for t in f["trees"]]] for uuid, f in answer.items()]
    arrays = (column.tobytes() for f in answer.values() for t in f["trees"] for column in t)
    return json.dumps({"devices": header}).encode() + b"\n" + b"".join(arrays)


def main() -> int:
    import numpy as np

    head, _, body = sys.stdin.buffer.read().partition(b"\n")
    request = json.loads(head)
    seed, at, answer = int(request["seed"]), 0, {}
    for uuid, rows, width in request["devices"]:
        data = np.frombuffer(body, dtype=np.float64, count=rows * width, offset=at)
        at += data.nbytes
        answer[uuid] = fit(data.reshape(rows, width), seed)
    sys.stdout.buffer.write(encode(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
