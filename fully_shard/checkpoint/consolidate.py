"""checkpoint.consolidate: a checkpoint's model weights as Hugging Face-style safetensors files (one process).

See design/checkpoint-format.md section 8. Model files are verified first; then the tensors are read
in groups of at most ``max_shard_bytes`` and written as ``model.safetensors`` or
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

import torch
from safetensors.torch import save_file

from . import safetensors_io as sio
from .boxes import full_box
from .codec import ST_TO_TORCH
from .control import Control
from .reader import Loader, Read
from .snapshot import Snapshot


def plan_output_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into output files of at most ``max_shard_bytes`` each.

    A tensor larger than the limit gets a file of its own (it cannot be split across files).
    """
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    groups: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes:
        if current and used + size > max_shard_bytes:
            groups.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not groups:
        groups.append(current)
    return groups


def consolidate(path: str | os.PathLike[str], out_dir: str | os.PathLike[str], *,
                max_shard_bytes: int = 5_000_000_000, verify: bool = True) -> list[str]:
    """Write the model weights as Hugging Face-style safetensors (single process, bounded memory).

    Produces ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``
    when the weights exceed ``max_shard_bytes``; full tensors under their original names, readable by
    ``safetensors.torch.load_file`` and ``transformers``. At most one output file's tensors (about
    ``max_shard_bytes``, or one larger tensor) are in memory at a time. Returns the written paths.
    """
    path = os.path.abspath(os.fspath(path))
    out = os.path.abspath(os.fspath(out_dir))
    snapshot = Snapshot(path)
    try:
        index = snapshot.index
        loader = Loader(Control.single(), snapshot)
        model_files = loader.digest_share({"model"})
        loader.digests = model_files if verify else set()
        snapshot.open(model_files)
        loader.check_files()
        names = list(index.model) + list(index.aliases)
        groups = plan_output_shards([(n, index.model[index.aliases.get(n, n)].nbytes) for n in names],
                                    max_shard_bytes)
        os.makedirs(out, exist_ok=True)
        targets = ["model.safetensors"] if len(groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        written = []
        weight_map: dict[str, str] = {}
        total = 0
        for target, group in zip(targets, groups):
            tensors = {}
            reads: list[Read] = []
            for name in group:
                entry = index.model[index.aliases.get(name, name)]
                tensors[name] = torch.empty(entry.shape, dtype=ST_TO_TORCH[entry.dtype])
                loader.add(reads, entry, full_box(entry.shape), tensors[name])
                weight_map[name] = target
                total += entry.nbytes
            loader.run(reads)
            tmp = os.path.join(out, f".{target}.tmp")
            save_file(tensors, tmp, metadata={"format": "pt"})
            sio.fsync_path(tmp)
            written.append((tmp, os.path.join(out, target)))
            del tensors
    finally:
        snapshot.close()
    return _publish(out, written, weight_map if len(groups) > 1 else None, total)


def _publish(out: str, written: list[tuple[str, str]], weight_map: dict[str, str] | None, total: int) -> list[str]:
    """Replace any previous output in ``out`` by the written files (and the index of a sharded output)."""
    stale = [n for n in os.listdir(out) if n == "model.safetensors.index.json" or n == "model.safetensors"
             or (n.startswith("model-") and n.endswith(".safetensors"))]
    for n in stale:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(out, n))
    for tmp, final in written:
        os.rename(tmp, final)
    results = [final for _, final in written]
    if weight_map is not None:
        index_path = os.path.join(out, "model.safetensors.index.json")
        with open(index_path, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        results.append(index_path)
    sio.fsync_path(out, directory=True)
    return results
