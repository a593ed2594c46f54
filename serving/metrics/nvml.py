"""GPU utilisation and memory from NVML, when `nvidia-ml-py` is installed (the `nvml`
extra) and a driver answers; otherwise nothing is exported. Read at scrape time."""

from __future__ import annotations

import logging

from prometheus_client.core import GaugeMetricFamily

logger = logging.getLogger(__name__)


def load_nvml():
    """The initialised `pynvml` module, or None (not installed, or no NVIDIA driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded on CPU machines
        logger.info("NVML unavailable (%s): no GPU utilisation metrics", exc)
        return None
    return pynvml


class NvmlCollector:
    """Per GPU (label `gpu`, NVML's index): utilisation over NVML's last sample period and
    memory used / total, as `qwen_jax:` gauges. `indices`: the GPUs to report (the
    replica's), default all."""

    def __init__(self, nvml, model_name: str, indices: list[int] | None = None):
        self.nvml = nvml
        self.model_name = model_name
        count = nvml.nvmlDeviceGetCount()
        self.indices = [i for i in (indices if indices is not None else range(count))
                        if 0 <= i < count]

    def collect(self):
        labels = ["model_name", "gpu"]
        util = GaugeMetricFamily("qwen_jax:gpu_utilization_perc",
                                 "NVML GPU utilisation: fraction of the last sample period a "
                                 "kernel ran (1 means 100 percent).", labels=labels)
        used = GaugeMetricFamily("qwen_jax:gpu_memory_used_bytes", "NVML memory used.",
                                 labels=labels)
        total = GaugeMetricFamily("qwen_jax:gpu_memory_total_bytes", "NVML memory total.",
                                  labels=labels)
        for i in self.indices:
            try:
                handle = self.nvml.nvmlDeviceGetHandleByIndex(i)
                rates = self.nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self.nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # a GPU fallen off the bus must not break /metrics
                logger.warning("NVML read of GPU %d failed: %s", i, exc)
                continue
            values = [self.model_name, str(i)]
            util.add_metric(values, rates.gpu / 100.0)
            used.add_metric(values, float(memory.used))
            total.add_metric(values, float(memory.total))
        yield from (util, used, total)
