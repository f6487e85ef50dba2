"""Seeded fuzz: hundreds of damaged copies of a small 2-rank checkpoint must each fail cleanly.

Every case must raise the same CheckpointError on both ranks, naming the file (or index.json and the key),
leave the model and the optimizer byte for byte as they were, and not hang (the harness has a hard
timeout). Mutations: byte flips (data, headers, index), truncations, appended bytes, zeroed ranges,
deleted, swapped, foreign and symlinked files, header length edits, and index edits with the digest
recomputed (what an adversary or a careless tool does) that only the cross-checks can catch.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fully_shard import checkpoint, fully_shard
from fully_shard.checkpoint import CheckpointError
from fully_shard.checkpoint import format as fmt
from tests.distributed.harness import distributed

SEED = int(os.environ.get("FS_FUZZ_SEED", "0"))
CASES = int(os.environ.get("FS_FUZZ_CASES", "250"))


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 3))
    model.register_buffer("calib", torch.arange(5.0) + seed)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _local_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    """This rank's model and optimizer state, as raw bytes (no collective)."""
    out = []
    for t in list(model.state_dict().values()) + [v for s in opt.state.values() for v in s.values()]:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if isinstance(t, DTensor) else t
            out.append(local.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    out.append(json.dumps([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
                          sort_keys=True, default=str).encode())
    return out


# ---- mutations: each takes (rng, case directory, good directory, foreign directory), returns a label.

def _files(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))


def _any_file(rng: random.Random, d: str) -> str:
    return rng.choice(_files(d) + ["index.json"])


def _header_len(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _flip_bit(path: str, offset: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _flip(rng: random.Random, d: str, *_: str) -> str:
    name = _any_file(rng, d)
    offset = rng.randrange(os.path.getsize(os.path.join(d, name)))
    _flip_bit(os.path.join(d, name), offset, rng.randrange(8))
    return f"flip {name}@{offset}"


def _flip_header(rng: random.Random, d: str, *_: str) -> str:
    name = rng.choice(_files(d))
    offset = rng.randrange(_header_len(os.path.join(d, name)))
    _flip_bit(os.path.join(d, name), offset, rng.randrange(8))
    return f"header flip {name}@{offset}"


def _truncate(rng: random.Random, d: str, *_: str) -> str:
    name = _any_file(rng, d)
    p = os.path.join(d, name)
    os.truncate(p, rng.randrange(os.path.getsize(p)))
    return f"truncate {name}"


def _append(rng: random.Random, d: str, *_: str) -> str:
    name = _any_file(rng, d)
    with open(os.path.join(d, name), "ab") as f:
        f.write(bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))))
    return f"append {name}"


def _zero(rng: random.Random, d: str, *_: str) -> str:
    name = _any_file(rng, d)
    p = os.path.join(d, name)
    size = os.path.getsize(p)
    start = rng.randrange(size)
    with open(p, "r+b") as f:
        f.seek(start)
        old = f.read(min(64, size - start))
        new = bytes(len(old)) if any(old) else b"\xff" * len(old)
        f.seek(start)
        f.write(new)
    return f"zero {name}@{start}"


def _delete(rng: random.Random, d: str, *_: str) -> str:
    name = _any_file(rng, d)
    os.remove(os.path.join(d, name))
    return f"delete {name}"


def _swap(rng: random.Random, d: str, *_: str) -> str:
    a, b = rng.sample(_files(d), 2)
    os.rename(os.path.join(d, a), os.path.join(d, "x"))
    os.rename(os.path.join(d, b), os.path.join(d, a))
    os.rename(os.path.join(d, "x"), os.path.join(d, b))
    return f"swap {a} {b}"


def _foreign(rng: random.Random, d: str, good: str, foreign: str) -> str:
    name = rng.choice(_files(d) + ["index.json"])
    shutil.copyfile(os.path.join(foreign, name), os.path.join(d, name))
    return f"foreign {name}"


def _symlink(rng: random.Random, d: str, good: str, foreign: str) -> str:
    name = _any_file(rng, d)
    outside = os.path.join(os.path.dirname(d), f"outside-{os.path.basename(d)}-{name}")
    shutil.copyfile(os.path.join(good, name), outside)  # identical bytes: only the link itself is wrong
    os.remove(os.path.join(d, name))
    os.symlink(outside, os.path.join(d, name))
    return f"symlink {name}"


def _header_length(rng: random.Random, d: str, *_: str) -> str:
    name = rng.choice(_files(d))
    p = os.path.join(d, name)
    n = _header_len(p) - 8
    value = rng.choice([0, 1, n - 8, n + 8, n + rng.randint(1, 7), 1 << 40, rng.randrange(1 << 64)])
    with open(p, "r+b") as f:
        f.write(struct.pack("<Q", value % (1 << 64)))
    return f"header length {name}={value}"


EDITS = ("offsets", "file", "key", "shape", "dtype", "size", "digest", "rank", "world", "swap", "blob ref",
         "drop chunk")


def _edit_index(rng: random.Random, d: str, *_: str, kinds: tuple[str, ...] = EDITS) -> str:
    """An index edit with its digest recomputed, restricted to what the data files' records can refute
    (with verify=False a recomputed file digest cannot be refuted: that is what verify=False skips)."""
    p = os.path.join(d, "index.json")
    doc = json.loads(Path(p).read_text())
    del doc[fmt.INDEX_DIGEST_KEY]
    chunks = [c for e in doc["model"].values() for c in e["chunks"]]
    tensors = list(doc["model"].values())
    kind = rng.choice(kinds)
    if kind == "offsets":
        c = rng.choice(chunks)
        c["offsets"] = [c["offsets"][0] + rng.choice([-1, 1]), *c["offsets"][1:]] if c["offsets"] else [0]
    elif kind == "file":
        c = rng.choice(chunks)
        c["file"] = rng.choice([f for f in doc["files"] if f != c["file"]])
    elif kind == "key":
        c = rng.choice(chunks)
        c["key"] = rng.choice([k for k in doc["model"] if k != c["key"]])
    elif kind == "shape":
        t = rng.choice([t for t in tensors if t["shape"]])
        t["shape"][-1] += 1
    elif kind == "dtype":
        rng.choice(tensors)["dtype"] = "F16"
    elif kind == "size":
        rng.choice(list(doc["files"].values()))["size"] += rng.choice([-1, 1, 8])
    elif kind == "digest":
        rng.choice(list(doc["files"].values()))["digest"] = f"{rng.randrange(1 << 128):032x}"
    elif kind == "rank":
        f = rng.choice(list(doc["files"].values()))
        f["rank"] = 1 - f["rank"]
    elif kind == "world":
        doc["world_size"] = 3
    elif kind == "swap":
        same = collections.defaultdict(list)
        for name, t in doc["model"].items():
            same[(t["dtype"], tuple(t["shape"]))].append(name)
        a, b = rng.choice([v for v in same.values() if len(v) > 1])[:2]
        doc["model"][a]["chunks"], doc["model"][b]["chunks"] = doc["model"][b]["chunks"], doc["model"][a]["chunks"]
    elif kind == "blob ref":
        doc["extra"]["rng"] = {"__tensor__": "extra/99"}
    else:
        t = rng.choice([t for t in tensors if len(t["chunks"]) > 1])
        t["chunks"].pop(rng.randrange(len(t["chunks"])))
    Path(p).write_text(fmt.seal(json.dumps(doc)))
    return f"resealed index edit: {kind}"


def _edit_index_unsealed(rng: random.Random, d: str, *_: str) -> str:
    """A valid-JSON edit of a value (extra, hyperparameters, a state name) with the stale digest kept."""
    p = Path(d, "index.json")
    text = p.read_text()
    edits = [(r'"lr": ?[0-9.e-]+', '"lr": "fast"'), (r'"step": ?1\b', '"step": 7'), (r'exp_avg"', 'exp_avX"'),
             (r'"weight_decay": ?[0-9.e-]+', '"weight_decay": 0.5'), (r'"sharded": ?true', '"sharded": false')]
    pattern, repl = rng.choice(edits)
    text, n = re.subn(pattern, repl, text, count=1)
    assert n == 1, pattern
    p.write_text(text)
    return f"index edit, stale digest: {repl}"


MUTATIONS: list[tuple[Callable[..., str], bool]] = [  # (mutation, load with verify=False as well)
    (_flip, False), (_flip, False), (_flip_header, True), (_truncate, False), (_append, False), (_zero, False),
    (_delete, False), (_swap, False), (_foreign, False), (_symlink, True), (_header_length, True),
    (_edit_index, False), (functools.partial(_edit_index, kinds=tuple(k for k in EDITS if k != "digest")), True),
    (_edit_index_unsealed, True),
]


KINDS = [  # (outcome, a fragment of its message), first match wins
    ("index digest", "index_digest"), ("file digest", "content digest"), ("file size", "bytes but index.json records"),
    ("file metadata vs index", "the file's metadata says"), ("tensor records vs index", "does not belong"),
    ("not valid JSON", "not valid JSON"), ("not valid UTF-8", "not valid UTF-8"), ("duplicate key", "duplicate key"),
    ("symbolic link", "symbolic link"), ("missing file", "file is missing"),
    ("no index", "not a fully_shard checkpoint"),
    ("header bounds", "header declares"), ("header bounds", "data offsets"), ("header bounds", "too short"),
    ("header bounds", "data bytes"), ("header malformed", "header"), ("chunk coverage", "covered by no chunk"),
    ("chunk coverage", "overlap"), ("chunk coverage", "outside the tensor's"),
    ("chunk coverage", "integers (one per dim"),
    ("chunk claimed twice", "is also used by"), ("dangling tensor reference", "not under 'blobs'"),
    ("structure vs model", "dtype/shape differs"),
]


def _kind(message: str) -> str:
    return next((kind for kind, fragment in KINDS if fragment in message), "other")


@distributed(world_size=2, timeout=150)
def _fuzz(tmp: str, seed: int, cases: int) -> dict[str, Any]:
    rank = dist.get_rank()
    good, foreign = os.path.join(tmp, "good"), os.path.join(tmp, "foreign")
    model, opt = _model(0)
    extra = {"step": 1, "rng": torch.arange(4, dtype=torch.uint8), "sched": (0.5, "cosine")}
    checkpoint.save(good, model, opt, extra=extra)
    other, other_opt = _model(1)
    checkpoint.save(foreign, other, other_opt, extra={**extra, "rng": torch.arange(4, dtype=torch.uint8) + 1})
    target, target_opt = _model(2)
    before = _local_bytes(target, target_opt)
    rng = random.Random(seed)
    outcomes: list[list[str]] = []
    for i in range(cases):
        mutate, also_unverified = MUTATIONS[rng.randrange(len(MUTATIONS))]
        case_rng = random.Random(rng.randrange(1 << 30))
        verify = not (also_unverified and case_rng.random() < 0.5)
        case = os.path.join(tmp, f"case-{i}")
        label = ""
        if rank == 0:
            shutil.copytree(good, case)
            label = mutate(case_rng, case, good, foreign)
        dist.barrier()
        try:
            checkpoint.load(case, target, target_opt, verify=verify, timeout=30)
            message = ""
        except CheckpointError as e:
            message = str(e)
        if not message:  # loaded (the test fails below): start again from a fresh target
            target, target_opt = _model(2)
        assert not message or _local_bytes(target, target_opt) == before, \
            f"case {i} ({label}, verify={verify}): a failed load changed the model/optimizer:\n{message}"
        outcomes.append([label, message, str(verify), case])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(case)
    return {"outcomes": outcomes}


def test_fuzzed_checkpoints_fail_cleanly_on_every_rank(tmp_path: Path) -> None:
    per_rank = [r["outcomes"] for r in _fuzz(str(tmp_path), SEED, CASES)]
    kinds: collections.Counter[str] = collections.Counter()
    mutations: collections.Counter[str] = collections.Counter()
    for (label, message, verify, case), (_, message1, _, _) in zip(*per_rank):
        assert message, f"{label} (verify={verify}) loaded without an error"
        assert message == message1, f"{label}: the ranks raised different errors:\n{message}\n---\n{message1}"
        assert case in message, f"{label}: the error names neither the checkpoint's file nor its path:\n{message}"
        assert "fix" in message, message
        kinds[_kind(message)] += 1
        mutations[label.split(" ")[0] if not label.startswith(("resealed", "index")) else label] += 1
    print(f"\nfuzz seed {SEED}: {sum(kinds.values())} cases, all failed cleanly on both ranks, state unchanged; "
          f"by error kind: {dict(kinds.most_common())}; by mutation: {dict(mutations.most_common())}")


IN_PLACE_CASES = int(os.environ.get("FS_FUZZ_IN_PLACE_CASES", "120"))


@distributed(world_size=2, timeout=150)
def _fuzz_in_place(tmp: str, seed: int, cases: int) -> dict[str, Any]:
    """The same mutations loaded with LoadMode.IN_PLACE: each fails clearly; a failure before any write changes
    nothing; a PartialLoadError's untouched tensors are as they were and its lists cover every tensor."""
    from tests.checkpoint import common as C

    rank = dist.get_rank()
    good, foreign = os.path.join(tmp, "good"), os.path.join(tmp, "foreign")
    model, opt = _model(0)
    extra = {"step": 1, "rng": torch.arange(4, dtype=torch.uint8), "sched": (0.5, "cosine")}
    checkpoint.save(good, model, opt, extra=extra)
    other, other_opt = _model(1)
    checkpoint.save(foreign, other, other_opt, extra={**extra, "rng": torch.arange(4, dtype=torch.uint8) + 1})
    rng = random.Random(seed + 1)
    outcomes: list[list[Any]] = []
    target: torch.nn.Module | None = None
    for i in range(cases):
        mutate, also_unverified = MUTATIONS[rng.randrange(len(MUTATIONS))]
        case_rng = random.Random(rng.randrange(1 << 30))
        verify = not (also_unverified and case_rng.random() < 0.5)
        case = os.path.join(tmp, f"case-{i}")
        label = ""
        if rank == 0:
            shutil.copytree(good, case)
            label = mutate(case_rng, case, good, foreign)
        dist.barrier()
        if target is None:
            target, target_opt = _model(2)
            before = C.local_bytes(target, target_opt)
        common, partial = "", False
        try:
            checkpoint.load(case, target, target_opt, verify=verify, timeout=30, mode=checkpoint.LoadMode.IN_PLACE)
        except checkpoint.PartialLoadError as e:
            common, partial = str(e.__cause__), True
            now = C.local_bytes(target, target_opt)
            assert sorted([*e.whole, *e.partly, *e.untouched]) == sorted(k for k in now if k != "param_groups"), label
            assert all(now[k] == before[k] for k in e.untouched), f"case {i} ({label}): an untouched tensor changed"
            assert now["param_groups"] == before["param_groups"], label
            assert "fix" in str(e) and f"on rank {rank} this load had written into" in str(e), str(e)
            target = None  # partly loaded: the next case starts from a fresh target
        except CheckpointError as e:
            common = str(e)
            assert C.local_bytes(target, target_opt) == before, \
                f"case {i} ({label}, verify={verify}): a load that failed before writing changed the state:\n{e}"
        if not common:
            target = None
        outcomes.append([label, common, partial, case])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(case)
    return {"outcomes": outcomes}


def test_fuzzed_checkpoints_in_place_fail_clearly_and_report_truthfully(tmp_path: Path) -> None:
    per_rank = [r["outcomes"] for r in _fuzz_in_place(str(tmp_path), SEED, IN_PLACE_CASES)]
    kinds: collections.Counter[str] = collections.Counter()
    for (label, common, partial, case), (_, common1, partial1, _) in zip(*per_rank):
        assert common, f"{label} loaded without an error"
        assert common == common1 and partial == partial1, f"{label}: the ranks disagree:\n{common}\n---\n{common1}"
        assert case in common and "fix" in common, common
        kinds[("partial: " if partial else "") + _kind(common)] += 1
    print(f"\nin-place fuzz seed {SEED}: {sum(kinds.values())} cases, all failed clearly on both ranks; "
          f"by outcome: {dict(kinds.most_common())}")
