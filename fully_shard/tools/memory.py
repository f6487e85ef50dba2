"""Process memory now, at its peak, and a new peak window: CUDA allocator stats on GPU, RSS on CPU."""

from __future__ import annotations

import os
import resource

import torch


def _read_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_memory(device: torch.device | None = None) -> int:
    """Bytes in use now: CUDA allocator's allocated bytes on GPU, resident set size on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def reset_peak_memory(device: torch.device | None = None) -> bool:
    """Start a new peak window. On CPU this resets the kernel's VmHWM (``/proc/self/clear_refs``);
    returns False where that is not possible (the peak is then the process's lifetime peak)."""
    if device is not None and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device | None = None) -> int:
    """Peak bytes since ``reset_peak_memory``: CUDA allocator peak on GPU, peak RSS on CPU."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    hwm = _read_status_kb("VmHWM:")
    if hwm is not None:
        return hwm * 1024
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
