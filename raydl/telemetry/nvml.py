"""GPU readings through NVML (`pynvml`, from the nvidia-ml-py package): utilisation, memory, power, temperature.

Read on a thread of their own, twice a second: four NVML calls on the training thread took ~2 ms of every step
on an H100 (raydl bench gpu, 2026-11-25), where a GPT-2 step is ~55 ms. A step's record carries the latest
readings, at most `INTERVAL_S` old.
"""

from __future__ import annotations

import threading
from typing import Any

INTERVAL_S = 0.5


class GpuMonitor:
    """Reads one device; `read()` returns {} when there is no GPU or NVML is unavailable."""

    def __init__(self, device_index: int | None, interval_s: float = INTERVAL_S):
        self.handle, self.latest = None, {}
        self.stopped = threading.Event()
        if device_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self.latest = self._sample()
        except Exception:   # no driver / no library: telemetry degrades, training goes on
            self.handle = None
            return
        threading.Thread(target=self._sample_until_stopped, args=(interval_s,), name="raydl-nvml",
                         daemon=True).start()

    def read(self) -> dict[str, Any]:
        return self.latest

    def close(self) -> None:
        self.stopped.set()

    def _sample_until_stopped(self, interval_s: float) -> None:
        while not self.stopped.wait(interval_s):
            try:
                self.latest = self._sample()
            except Exception:   # the device went away mid-run: keep the last readings
                return

    def _sample(self) -> dict[str, Any]:
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        return {
            "gpu_util_pct": util.gpu,
            "gpu_mem_used_mb": mem.used / 2**20,
            "gpu_power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "gpu_temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        }
