"""What machine a benchmark ran on, for its report."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(**extra: Any) -> dict[str, Any]:
    """The machine line of a benchmark's JSON."""
    return {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": platform.python_version(), **extra}
