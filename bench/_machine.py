"""What every benchmark reports about the machine it ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_name() -> str:
    """The CPU model from lscpu, else what platform knows."""
    cpu = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return cpu
