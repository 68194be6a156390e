"""kepler-bridge: one agent per node for accelerator and workload energy metrics."""

__version__ = "0.1.0"
