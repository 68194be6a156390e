"""The short-lived child that fits the IsolationForests: `python -I fit.py` reads
{"seed": N, "devices": {uuid: rows}} as JSON on stdin and prints each device's trees as JSON.

scikit-learn, numpy and scipy cost the process that imports them about 100 MiB; in this child
they are gone when it exits, and the worker scores with the plain lists it prints.
"""

from __future__ import annotations

import json
import sys
from typing import Any

TREES = 50
MAX_SAMPLES = 256


def fit(rows: list[list[float]], seed: int) -> dict[str, Any]:
    """One device's forest: per tree its node lists (left, right, feature, threshold, length, low,
    high), a leaf pointing at itself, and the number of rows each tree was grown on."""
    import numpy as np
    from sklearn.ensemble import IsolationForest

    data = np.asarray(rows, dtype=float)
    samples = min(MAX_SAMPLES, len(data))
    model = IsolationForest(n_estimators=TREES, max_samples=samples, random_state=seed).fit(data)
    grown = zip(model.estimators_, model.estimators_features_, model.estimators_samples_)
    trees = [_tree(e.tree_, data[np.ix_(s, f)], f) for e, f, s in grown]
    return {"samples": samples, "trees": trees}


def _tree(tree: Any, grown_on: Any, features: Any) -> list[list[float]]:
    """A tree's node lists. `length` is a leaf's depth plus the expected depth of its rows, an
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
    return [
        np.where(leaf, nodes, tree.children_left[:count]).tolist(),
        np.where(leaf, nodes, tree.children_right[:count]).tolist(),
        np.where(leaf, 0, np.asarray(features)[split]).tolist(),
        np.where(leaf, np.inf, tree.threshold[:count]).tolist(),
        np.where(leaf, depth + _path_length(tree.n_node_samples[:count]), depth + 1).tolist(),
        np.where(leaf, -np.inf, low).tolist(),
        np.where(leaf, np.inf, high).tolist(),
    ]


def _path_length(n: Any) -> Any:
    """The mean depth of an unsuccessful search in a binary search tree of n rows."""
    import numpy as np

    n = np.asarray(n, dtype=float)
    deep = 2.0 * (np.log(np.maximum(n - 1.0, 1.0)) + 0.5772156649015329) - 2.0 * (n - 1.0) / n
    return np.where(n > 2, deep, np.where(n == 2, 1.0, 0.0))


def main() -> int:
    request = json.load(sys.stdin)
    seed = int(request["seed"])
    devices = request["devices"]
    answer = {uuid: fit(rows, seed) for uuid, rows in devices.items()}
    json.dump(answer, sys.stdout, allow_nan=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
