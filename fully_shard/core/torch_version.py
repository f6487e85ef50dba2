"""The running torch's (major, minor) version: the one place the library reads it, for the behaviours that
follow the torch it runs on (docs/torch.md, "Differences from torch's FSDP2") and compat's rebinding table."""

from __future__ import annotations

import torch

Version = tuple[int, int]


def parse(version: str) -> Version:
    """``"2.15.0+cu132"`` -> ``(2, 15)``; a development build ``"2.16.0a0+git..."`` -> ``(2, 16)``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION: Version = parse(torch.__version__)


def at_least(major: int, minor: int) -> bool:
    return (major, minor) <= TORCH_VERSION
