"""The nvml source (NVIDIA GPUs through NVML, the `pynvml` module of nvidia-ml-py) and its pieces.

source.py is the source: it reads every GPU once per sample. device.py holds what the source
remembers about one GPU and the NVML call that remembers which values a GPU cannot report;
processes.py reads the processes on a GPU; library.py finds, loads and initialises
libnvidia-ml.so.1; events.py is the thread that waits for XID errors and counts them; gpm.py
takes each GPU's GPM samples and turns them into profiling metrics; reliability.py reads
remapped rows, retired pages, PCIe replays and clock-event time, and links.py the NVLinks. A
reader of a further NVML feature (MIG) goes in a module of its own beside them, taking a
`Device`, and source.py calls it.
"""
