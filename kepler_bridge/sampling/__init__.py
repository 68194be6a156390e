"""One sample per interval: read the sources, check and number the readings, attribute energy,
build a Snapshot.

sampler.py runs the loop; sanitize.py is the check every reading passes; device_index.py gives
devices their node-wide `gpu` index; counters.py keeps counters monotonic; attribution.py splits
node and device energy over processes, containers and pods, with cpu_energy.py and gpu_energy.py
for the two kinds and ledger.py for the accumulated joules; top.py bounds per-process counters;
carry.py saves and loads all of this state across a worker restart.
"""
