"""GPU readings through NVML (`pynvml`, from the nvidia-ml-py package): utilisation, memory, power, temperature."""

from __future__ import annotations

from typing import Any


class GpuMonitor:
    """Reads one device; `read()` returns {} when there is no GPU or NVML is unavailable."""

    def __init__(self, device_index: int | None):
        self.handle = None
        if device_index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        except Exception:   # no driver / no library: telemetry degrades, training goes on
            self.handle = None

    def read(self) -> dict[str, Any]:
        if self.handle is None:
            return {}
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        return {
            "gpu_util_pct": util.gpu,
            "gpu_mem_used_mb": mem.used / 2**20,
            "gpu_power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "gpu_temp_c": n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU),
        }
