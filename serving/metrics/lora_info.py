"""vLLM's `lora_requests_info` gauge: one series whose labels name the adapters of running
and of waiting requests (comma-joined) and the device slots (`max_lora`), read from the
engine's stats at scrape time; its value is the wall time of the last update (the
engine's last step, or a change of the labels), as vLLM sets it."""

from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class LoRAInfoCollector:
    def __init__(self, llm, prefix: str):
        self.llm, self.name = llm, f"{prefix}:lora_requests_info"
        self.updated = time.time()
        self._labels: list[str] = []

    def on_step(self) -> None:
        self.updated = time.time()

    def collect(self):
        s = self.llm.stats()
        labels = [str(s["max_loras"]), ",".join(s["lora_waiting_adapters"]),
                  ",".join(s["lora_running_adapters"])]
        if labels != self._labels:
            self._labels, self.updated = labels, time.time()
        family = GaugeMetricFamily(self.name, "Running stats on lora requests.",
                                   labels=list(LABELS))
        family.add_metric(labels, self.updated)
        yield family
