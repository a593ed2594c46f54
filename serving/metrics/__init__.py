"""What the server exports about itself: the Prometheus collectors (vLLM's names too),
NVML readings of the GPUs, and the cost model that turns a step's shape into FLOPs and
bytes (MFU / MBU).

Imports only `serving.core`.
"""
