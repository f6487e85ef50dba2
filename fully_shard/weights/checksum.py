"""The checksum of a payload record: the same number for the same bytes on the sending and receiving side.

Both sides compute it on the transfer's device (the process group's: CPU for gloo, the GPU for NCCL),
so they always use the same function: xxh3-64 of the bytes on CPU; on an accelerator a position-
weighted sum of the 16-bit words, exact in int64 (no byte leaves the device). ``NAME`` of each is sent
in the header; a receiver that would use another refuses the send.
"""

from __future__ import annotations

import torch
import xxhash

_CHUNK = 1 << 20  # 16-bit words summed per step (the products stay below 2**31, a chunk's sum below 2**51)
_PRIME = (1 << 61) - 1
_WEIGHTS: dict[torch.device, torch.Tensor] = {}  # process-wide: the checksum's fixed weights per device, made once


def name_for(device: torch.device) -> str:
    return "xxh3_64" if device.type == "cpu" else "wsum16"


def checksum(data: torch.Tensor) -> int:
    """Checksum of a contiguous uint8 tensor's bytes."""
    assert data.dtype == torch.uint8 and data.dim() == 1
    if data.device.type == "cpu":
        return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))  # type: ignore[arg-type]
    return _weighted_sum(data)


def _weighted_sum(data: torch.Tensor) -> int:
    n = data.numel()
    if n % 2:
        data = torch.cat([data, data.new_zeros(1)])
    words = data.view(torch.int16)
    weights = _WEIGHTS.get(data.device)
    if weights is None:
        weights = _WEIGHTS[data.device] = torch.arange(_CHUNK, device=data.device, dtype=torch.int64) % 65521 + 1
    s1 = s2 = 0
    for start in range(0, words.numel(), _CHUNK):
        w = words[start:start + _CHUNK].to(torch.int64)
        s1 = (s1 + int(w.sum().item())) % _PRIME
        s2 = (s2 + int((w * weights[:w.numel()]).sum().item()) * (start // _CHUNK + 1)) % _PRIME
    return (s1 * 1_000_003 + s2 + n) % _PRIME
