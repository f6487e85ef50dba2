"""The directory protocol: temporary siblings, the atomic commit rename, crash recovery and retention.

Commit protocol (see design/checkpoint-format.md section 5): every rank writes into ``.NAME.tmp-NONCE``
next to ``path``; rank 0 writes ``index.json`` last, fsyncs, then renames the directory onto ``path``.
An existing checkpoint is first renamed aside to ``.NAME.old-NONCE``; ``recover`` finishes or rolls back
an interrupted commit, so a crash at any instant leaves ``path`` (or a recoverable sibling) loadable.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid

from . import format as fmt
from . import safetensors_io as sio
from .errors import CheckpointError


def tmp_dir(path: str, nonce: str) -> str:
    return _sibling(path, "tmp", nonce)


def _sibling(path: str, kind: str, nonce: str) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{kind}-{nonce}")


def new_nonce() -> str:
    return uuid.uuid4().hex[:16]


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, fmt.INDEX_FILE))


def _siblings(path: str) -> list[tuple[str, str, str]]:
    """(kind, nonce, full path) of this checkpoint's temporary/old/deleting siblings."""
    parent, name = os.path.split(path)
    pattern = re.compile(r"^\." + re.escape(name) + r"\.(tmp|old|deleting)-([0-9a-f]+)$")
    out = []
    try:
        entries = os.listdir(parent or ".")
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.match(entry)
        if m:
            out.append((m.group(1), m.group(2), os.path.join(parent, entry)))
    return out


def committed_sibling(path: str) -> str | None:
    """Read-only: the complete sibling that holds ``path``'s newest committed data while ``path`` is missing.

    A commit interrupted between its two renames (or a writer caught between them) leaves ``.old-N`` and
    the complete ``.tmp-N``: the new generation is ``.tmp-N``. Only complete ``.old-*`` directories left
    (not produced by this sequence): the old data.
    """
    siblings = _siblings(path)
    olds = {nonce: p for kind, nonce, p in siblings if kind == "old" and is_complete(p)}
    tmps = {nonce: p for kind, nonce, p in siblings if kind == "tmp" and is_complete(p)}
    return next((tmps[n] for n in olds if n in tmps), None) or next(iter(olds.values()), None)


def recover(path: str) -> list[str]:
    """Writer side: finish or roll back an interrupted commit of ``path``, then delete leftovers.

    Single writer per path: rank 0 calls it at the start of every save. Returns the actions taken.
    ``load`` never calls it (a load never modifies the directory; it reads committed_sibling instead).
    """
    actions = []
    parent = os.path.dirname(path) or "."
    if not os.path.exists(path):
        promote = committed_sibling(path)
        if promote is not None:
            os.rename(promote, path)
            sio.fsync_path(parent, directory=True)
            actions.append(f"restored {path} from {os.path.basename(promote)}")
    for kind, _, p in _siblings(path):
        shutil.rmtree(p, ignore_errors=True)
        actions.append(f"removed leftover {kind} directory {os.path.basename(p)}")
    return actions


def check_target(path: str) -> None:
    """``save`` replaces only checkpoints (or an empty directory): never a user's file or directory."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory; save writes a checkpoint directory and "
                              "will not replace it; fix: choose another path")
    if not is_complete(path) and os.listdir(path):
        raise CheckpointError(f"{path} exists and is not a fully_shard checkpoint (no {fmt.INDEX_FILE}); save "
                              "replaces only checkpoints; fix: choose another path or remove the directory")


def commit(tmp: str, path: str, nonce: str) -> None:
    """Rename the complete ``tmp`` directory onto ``path`` (moving an existing checkpoint aside first)."""
    parent = os.path.dirname(path) or "."
    sio.fsync_path(tmp, directory=True)
    if os.path.lexists(path):
        if not os.path.isdir(path) or os.path.islink(path):
            raise CheckpointError(f"{path} exists and is not a checkpoint directory; fix: choose another path")
        old = _sibling(path, "old", nonce)
        os.rename(path, old)
        os.rename(tmp, path)
        sio.fsync_path(parent, directory=True)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
        sio.fsync_path(parent, directory=True)


def retain(path: str, keep_last: int) -> list[str]:
    """Delete older checkpoints of ``path``'s series so that ``keep_last`` remain; return the deleted names.

    The series is the sibling directories that hold an ``index.json`` and whose names equal ``path``'s
    except for the step, the last run of digits (``exp1-step-000300``, ``exp1-step-600``; never
    ``exp2-step-000300`` or ``seed1-step-900`` for ``seed2-step-100``). They are ordered by step number;
    ``path`` itself is always kept. Each victim is renamed to a hidden name before it is deleted, so a
    crash never leaves a half-deleted directory under a checkpoint name.
    """
    parent, name = os.path.split(path)
    key = series_key(name)
    if key is None:
        return []
    series = []
    for entry in os.listdir(parent or "."):
        full = os.path.join(parent, entry)
        k = series_key(entry)
        if k is not None and k[:2] == key[:2] and os.path.isdir(full) and not os.path.islink(full) \
                and is_complete(full):
            series.append((k[2], entry, full))
    series.sort()
    keep = {full for _, _, full in series[-keep_last:]} | {path}
    removed = []
    for _, entry, full in series:
        if full in keep:
            continue
        doomed = _sibling(full, "deleting", new_nonce())
        os.rename(full, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(entry)
    if removed:
        sio.fsync_path(parent or ".", directory=True)
    return removed


_SERIES_RE = re.compile(r"^(.*\D)?(\d+)(\D*)$")


def series_key(name: str) -> tuple[str, str, int] | None:
    """(prefix, suffix, step) for retention, the step being the last digit run: 'exp1-step-000300' ->
    ('exp1-step-', '', 300); None for names without digits and hidden names."""
    m = _SERIES_RE.match(name)
    if m is None or name.startswith("."):
        return None
    return m.group(1) or "", m.group(3), int(m.group(2))
