"""Anomaly detection on each accelerator's series, in its own thread: the named detectors
(`detectors.py`), the IsolationForest for the rest (`forest.py`), and the thread that runs them on
the store's snapshots (`monitor.py`)."""

# The named failure modes, as the `kind` label of gpu_anomaly; "unusual" is the IsolationForest's.
KINDS = ("stuck", "cooling", "memory_leak", "frozen_sensor", "throttling", "error_burst")
UNUSUAL = "unusual"
