"""Shared by the benchmarks: machine description and result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if cpuinfo.exists() else platform.processor()
    info = {"nproc": os.cpu_count(), "cpu_model": model, "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
