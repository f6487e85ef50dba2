"""load_hf / save_hf against transformers' own from_pretrained, at 2 and 3 (uneven) ranks and a 2-D mesh.

Every check compares with the unsharded truth: logits of ``from_pretrained`` (fp32 compute, 1e-5),
parameters bitwise, files bitwise after ``save_hf``. The loader's I/O is counted on every rank (bytes
read == the bytes of the blocks it holds, dtype-conversion buffers smaller than any full tensor), and
every bad input fails on every rank with the model unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.profiler import ProfilerActivity, profile

from fully_shard import fully_shard
from fully_shard.checkpoint import (
    CheckpointError,
    Fuse,
    KeyMap,
    Split,
    Stack,
    Transpose,
    direct,
    hf_load,
    hf_save,
    load_hf,
    save_hf,
)
from fully_shard.checkpoint import format as fmt
from fully_shard.checkpoint.safetensors_io import DataFile
from tests.checkpoint.common import assert_clear_errors
from tests.distributed.harness import distributed

transformers = pytest.importorskip("transformers")

CFG = dict(vocab_size=101, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
IDS = (torch.arange(14).reshape(2, 7) * 7) % 101


def _config(tie: bool) -> Any:
    return transformers.LlamaConfig(**CFG, tie_word_embeddings=tie)


def _write_llama(d: str, *, tie: bool, dtype: torch.dtype, shard_size: str) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config(tie)).to(dtype).save_pretrained(d, max_shard_size=shard_size)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _sharded_llama(tie: bool, dim: int, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)  # a different init than the files: every parameter must come from load_hf
    model = transformers.LlamaForCausalLM(_config(tie))
    fn = (lambda p: Shard(1) if p.ndim == 2 else None) if dim == 1 else None
    for layer in model.model.layers:
        fully_shard(layer, shard_placement_fn=fn)
    fully_shard(model, shard_placement_fn=fn)
    return model


@contextmanager
def _count_io() -> Iterator[dict[str, Any]]:
    """Bytes this rank reads of tensor data (headers aside; a direct read's range before its widening to whole
    pages), the bytes of the blocks it asks for ("wanted"), and the largest read buffer load_hf allocates
    (dtype-conversion scratch or page-aligned direct-read buffer)."""
    seen: dict[str, Any] = {"read": 0, "wanted": 0, "scratch": 0, "keys": set()}
    lock, in_box = threading.Lock(), threading.local()
    read_into, read_box, scratch = DataFile.read_into, DataFile.read_box, hf_load.scratch
    copy_direct, read_range, get = hf_load._ReadPlan._copy_direct, hf_load.read_range, direct.AlignedArena.get

    def counted_read(self: DataFile, buf: memoryview, offset: int) -> None:
        if getattr(in_box, "on", False):
            with lock:
                seen["read"] += len(buf)
        read_into(self, buf, offset)

    def counted_box(self: DataFile, key: str, part: Any, dst: torch.Tensor) -> None:
        with lock:
            seen["keys"].add(key)
            seen["wanted"] += part.numel * fmt.DTYPE_SIZES[self.header().tensors[key][0]]
        in_box.on = True
        try:
            read_box(self, key, part, dst)
        finally:
            in_box.on = False

    def counted_scratch(sizes: tuple[int, ...], dtype: torch.dtype, arena: Any) -> torch.Tensor:
        out = scratch(sizes, dtype, arena)
        with lock:
            seen["scratch"] = max(seen["scratch"], out.numel() * out.element_size())
        return out

    def counted_direct(f: DataFile, fd: int, r: Any, pages: Any) -> bool:
        done = copy_direct(f, fd, r, pages)
        if done:
            with lock:
                seen["keys"].add(r.key)
                seen["wanted"] += r.part.numel * r.dtype.itemsize
        return done

    def counted_range(fd: int, direct_fd: int | None, begin: int, end: int, *args: Any) -> Any:
        with lock:
            seen["read"] += end - begin
        return read_range(fd, direct_fd, begin, end, *args)

    def counted_get(self: Any, nbytes: int) -> Any:
        with lock:
            seen["scratch"] = max(seen["scratch"], nbytes)
        return get(self, nbytes)

    with mock.patch.object(DataFile, "read_into", counted_read), mock.patch.object(DataFile, "read_box", counted_box), \
            mock.patch.object(hf_load, "scratch", counted_scratch), \
            mock.patch.object(hf_load._ReadPlan, "_copy_direct", staticmethod(counted_direct)), \
            mock.patch.object(hf_load, "read_range", counted_range), \
            mock.patch.object(direct.AlignedArena, "get", counted_get):
        yield seen


def _held_bytes(model: nn.Module, itemsize: int) -> int:
    """Bytes of the blocks this rank holds (tied parameters once), at the file's element size."""
    seen, total = set(), 0
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += (t.to_local() if isinstance(t, DTensor) else t).numel() * itemsize
    return total


@distributed(world_size=2)
def _llama_w2(tmp: str) -> None:
    _check_llama(tmp)


@distributed(world_size=3)
def _llama_w3(tmp: str) -> None:
    _check_llama(tmp)


def _check_llama(tmp: str) -> None:
    """Untied fp32 files (4 files + index) and tied bf16 files (one file), Shard(0) and Shard(1) placements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, tie, file_dtype, dim in (("fp32-untied", False, torch.float32, 0), ("bf16-tied", True, torch.bfloat16, 1),
                                       ("fp32-untied", False, torch.float32, 1)):
        d = os.path.join(tmp, name)
        ref = transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
        model = _sharded_llama(tie, dim)
        piece = 200 if file_dtype == torch.bfloat16 else hf_load._PIECE_BYTES  # small pieces: exercise the cutting
        with _count_io() as io, mock.patch.object(hf_load, "_PIECE_BYTES", piece), \
                profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            assert load_hf(d, model, threads=1 if dim == 1 else 4) == ([], [])  # 1: every allocation is seen
        with torch.no_grad():
            want, got = ref(IDS).logits, model(IDS).logits
        assert (got - want).abs().max().item() <= 1e-5, (name, dim, (got - want).abs().max())
        ref_sd = ref.state_dict()
        for key, p in model.state_dict().items():
            assert torch.equal(_full(p), ref_sd[key]), (name, key)
        if tie:
            assert model.lm_head.weight is model.model.embed_tokens.weight, "the tie was lost"
        # Shard on read: exactly the bytes of this rank's blocks, read as such for whole rows; a column block
        # (Shard(1)) as the range enclosing its rows where that is at most twice its bytes (test_reads.py counts
        # the preads); conversion buffers far below any full tensor.
        assert io["wanted"] == _held_bytes(model, file_dtype.itemsize), (name, rank, io["wanted"])
        assert io["read"] == io["wanted"] if dim == 0 else io["wanted"] <= io["read"] <= 2 * io["wanted"], \
            (name, rank, io["read"], io["wanted"])
        largest = max(t.numel() * file_dtype.itemsize for t in ref_sd.values())
        if dim == 1:  # the profiler sees the main thread's allocations: the load ran there (threads=1)
            allocations = sorted(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
            assert allocations and allocations[-1] < largest, (name, allocations[-5:], largest)
        # Read buffers: a piece (or one row), widened to whole pages for a direct read; never a full tensor's.
        assert 0 < io["scratch"] <= direct.round_up(max(piece, 24 * file_dtype.itemsize), direct.ALIGN) + \
            direct.ALIGN, io["scratch"]
        assert io["scratch"] < largest or piece < largest < direct.ALIGN, (io["scratch"], largest)
    # save_hf -> from_pretrained, bitwise, several files written by several ranks.
    model = _sharded_llama(False, 0, seed=3)
    out = os.path.join(tmp, f"saved-{world}")
    names = save_hf(out, model, max_shard_size="20KB")
    assert len(names) > 2 and names[0] == f"model-00001-of-{len(names):05d}.safetensors", names
    if rank == 0:
        _config(False).save_pretrained(out)
    dist.barrier()
    back = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    for key, p in model.state_dict().items():
        assert torch.equal(_full(p), back.state_dict()[key]), key
    assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)  # no temporary file left
    # Saving again with one file replaces the shards and the index.
    assert save_hf(out, model) == ["model.safetensors"]
    dist.barrier()
    assert sorted(n for n in os.listdir(out) if "safetensors" in n) == ["model.safetensors"], os.listdir(out)


def _prepare_llama(tmp: Path) -> None:
    _write_llama(str(tmp / "fp32-untied"), tie=False, dtype=torch.float32, shard_size="20KB")
    _write_llama(str(tmp / "bf16-tied"), tie=True, dtype=torch.bfloat16, shard_size="5GB")
    assert len(list((tmp / "fp32-untied").glob("*.safetensors"))) > 2
    assert not (tmp / "bf16-tied" / "model.safetensors.index.json").exists()


def test_llama_2_ranks(tmp_path: Path) -> None:
    _prepare_llama(tmp_path)
    _llama_w2(str(tmp_path))


def test_llama_3_ranks_uneven(tmp_path: Path) -> None:
    _prepare_llama(tmp_path)
    _llama_w3(str(tmp_path))


# ------------------------------------------------------------------------------------------------------
# Structural transforms: fused QKV, stacked experts, a split, a transpose.

E, LAYERS = 5, 2
KEY_MAP = KeyMap({"model.norm.weight": "final_norm.weight"}, transforms=[
    Fuse("layers.*.qkv", ["model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.k_proj.weight",
                          "model.layers.*.self_attn.v_proj.weight"], sizes=[8, 4, 4]),
    Stack("layers.*.experts.w1", "model.layers.*.mlp.experts.#.gate_proj.weight"),
    Split("model.layers.*.mlp.gate_up.weight", ["layers.*.gate", "layers.*.up"]),
    Transpose("layers.*.o_t", "model.layers.*.self_attn.o_proj.weight"),
])


def _hf_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {"model.norm.weight": torch.randn(6, generator=g)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for n, rows in (("q", 8), ("k", 4), ("v", 4)):
            out[p + f"self_attn.{n}_proj.weight"] = torch.randn(rows, 6, generator=g)
        for e in range(E):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = torch.randn(7, 6, generator=g)
        out[p + "mlp.gate_up.weight"] = torch.randn(10, 6, generator=g)
        out[p + "self_attn.o_proj.weight"] = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    return out


def _write_dir(d: str, tensors: dict[str, torch.Tensor], files: int) -> None:
    os.makedirs(d, exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for i in range(files):
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::files]}
        save_file(part, os.path.join(d, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    Path(d, "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


class _Transformed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.final_norm = nn.Module()
        self.final_norm.weight = nn.Parameter(torch.zeros(6))
        self.layers = nn.ModuleList()
        for _ in range(LAYERS):
            layer = nn.Module()
            layer.qkv = nn.Parameter(torch.zeros(16, 6))
            layer.experts = nn.Module()
            layer.experts.w1 = nn.Parameter(torch.zeros(E, 7, 6))
            layer.gate = nn.Parameter(torch.zeros(4, 6))
            layer.up = nn.Parameter(torch.zeros(6, 6))
            layer.o_t = nn.Parameter(torch.zeros(8, 6))
            self.layers.append(layer)


def _expected(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"final_norm.weight": hf["model.norm.weight"]}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[f"layers.{i}.qkv"] = torch.cat([hf[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        out[f"layers.{i}.experts.w1"] = torch.stack([hf[p + f"mlp.experts.{e}.gate_proj.weight"] for e in range(E)])
        out[f"layers.{i}.gate"], out[f"layers.{i}.up"] = hf[p + "mlp.gate_up.weight"].split([4, 6])
        out[f"layers.{i}.o_t"] = hf[p + "self_attn.o_proj.weight"].float().t()
    return out


def _check_transforms(tmp: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    hf = _hf_tensors()
    model = fully_shard(_Transformed())
    with _count_io() as io:
        load_hf(os.path.join(tmp, "src"), model, key_map=KEY_MAP)
    want = _expected(hf)
    for key, p in model.state_dict().items():
        assert torch.equal(_full(p), want[key]), key
    # Only the local experts' files ranges, and exactly the bytes of the held blocks.
    per = -(-E // world)
    local = set(range(rank * per, min(E, (rank + 1) * per)))
    read_experts = {int(k.split(".")[5]) for k in io["keys"] if ".experts." in k}
    assert read_experts == local, (rank, read_experts, local)
    held = sum(p.to_local().numel() * 4 for p in model.parameters())  # type: ignore[attr-defined]
    o_t_bytes = sum(model.layers[i].o_t.to_local().numel() * 2 for i in range(LAYERS))  # type: ignore[union-attr]
    assert io["wanted"] == held - o_t_bytes, (io["wanted"], held, o_t_bytes)  # o_proj is bf16 in the file
    assert io["wanted"] <= io["read"] <= 2 * io["wanted"], io  # o_t's rows are o_proj's columns: enclosing ranges
    # The same map, inverted: save_hf writes the HF tensors back bitwise (dtype: the model's, so o_proj is F32).
    out = os.path.join(tmp, f"out-{world}")
    save_hf(out, model, key_map=KEY_MAP, max_shard_size=600)
    dist.barrier()
    index = json.loads(Path(out, "model.safetensors.index.json").read_text())
    back: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        back.update(load_file(os.path.join(out, name)))
    assert sorted(back) == sorted(hf)
    for key, t in hf.items():
        assert torch.equal(back[key], t.float()), key


@distributed(world_size=2)
def _transforms_w2(tmp: str) -> None:
    _check_transforms(tmp)


@distributed(world_size=3)
def _transforms_w3(tmp: str) -> None:
    _check_transforms(tmp)


def test_key_map_transforms(tmp_path: Path) -> None:
    _write_dir(str(tmp_path / "src"), _hf_tensors(), files=3)
    _transforms_w2(str(tmp_path))
    _transforms_w3(str(tmp_path))


# ------------------------------------------------------------------------------------------------------
# 2-D meshes: TP-style placements (FSDP over TP's _StridedShard, Shard(1), Replicate), and a TP Llama.

def _layouts_2d() -> list[tuple[str, tuple[int, ...], list[Any]]]:
    from torch.distributed.tensor.placement_types import _StridedShard
    return [("colwise", (8, 3), [_StridedShard(0, split_factor=2), Shard(0)]),
            ("rowwise", (6, 11), [Shard(0), Shard(1)]),
            ("dim1", (5, 7), [Shard(1), Replicate()]),
            ("rep", (3,), [Replicate(), Shard(0)])]


@distributed(world_size=4)
def _two_d(tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    hf = load_file(os.path.join(tmp, "2d", "model.safetensors"))
    module = nn.Module()
    for name, shape, placements in _layouts_2d():
        module.register_parameter(name, nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements)))
    with _count_io() as io:
        load_hf(os.path.join(tmp, "2d"), module)
    for name, p in module.named_parameters():
        assert torch.equal(_full(p), hf[name]), name
    assert io["wanted"] == sum(p.to_local().numel() * 4 for p in module.parameters())  # type: ignore[attr-defined]
    assert io["wanted"] <= io["read"] <= 2 * io["wanted"], io  # column blocks: enclosing ranges (test_reads.py)
    save_hf(os.path.join(tmp, "2d-out"), module)
    dist.barrier()
    back = load_file(os.path.join(tmp, "2d-out", "model.safetensors"))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    # A tensor-parallel Llama: MLP colwise/rowwise over tp, fully_shard over dp (2-D DTensors, _StridedShard).
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(_config(False))
    for layer in model.model.layers:
        parallelize_module(layer.mlp, mesh["tp"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                                   "down_proj": RowwiseParallel()})
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    placements = {tuple(p.placements) for n, p in model.named_parameters() if "mlp" in n}  # type: ignore[attr-defined]
    assert len(placements) == 2 and all(len(p) == 2 for p in placements), placements
    src = os.path.join(tmp, "bf16-untied")
    load_hf(src, model)
    ref = transformers.LlamaForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        assert (model(IDS).logits - ref(IDS).logits).abs().max().item() <= 1e-5
    out = os.path.join(tmp, "tp-out")
    save_hf(out, model, max_shard_size="20KB")
    dist.barrier()
    merged: dict[str, torch.Tensor] = {}
    for name in os.listdir(out):
        merged.update(load_file(os.path.join(out, name)) if name.endswith(".safetensors") else {})
    assert sorted(merged) == sorted(ref.state_dict())
    assert all(torch.equal(merged[k], v) for k, v in ref.state_dict().items())


def test_two_d_mesh(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    os.makedirs(tmp_path / "2d")
    save_file({n: torch.randn(s, generator=g) for n, s, _ in _layouts_2d()}, str(tmp_path / "2d" / "model.safetensors"),
              metadata={"format": "pt"})
    _write_llama(str(tmp_path / "bf16-untied"), tie=False, dtype=torch.bfloat16, shard_size="20KB")
    _two_d(str(tmp_path))


# ------------------------------------------------------------------------------------------------------
# Bad input: the same error on every rank, naming the file and key; the model unchanged.

F1 = "model-00001-of-00004.safetensors"
F2 = "model-00002-of-00004.safetensors"
INDEX = "model.safetensors.index.json"


def _edit_file(d: str, name: str, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Rewrite one data file with ``edit`` applied, and the index to match."""
    tensors = load_file(os.path.join(d, name))
    edit(tensors)
    os.remove(os.path.join(d, name))
    save_file(tensors, os.path.join(d, name), metadata={"format": "pt"})
    doc = json.loads(Path(d, INDEX).read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if v != name} | dict.fromkeys(tensors, name)
    Path(d, INDEX).write_text(json.dumps(doc))


def _first_key(d: str, name: str) -> str:
    return sorted(load_file(os.path.join(d, name)))[0]


def _replace(path: str, make: Callable[[str], object]) -> None:
    os.remove(path)
    make(path)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x55]))


def _retarget(d: str) -> None:
    doc = json.loads(Path(d, INDEX).read_text())
    key = _first_key(d, F1)
    doc["weight_map"][key] = F2
    Path(d, INDEX).write_text(json.dumps(doc))


BAD: dict[str, tuple[Callable[[str], object], list[str]]] = {
    "missing key": (lambda d: _edit_file(d, F1, lambda t: t.pop(_first_key(d, F1))), ["missing in checkpoint"]),
    "unexpected key": (lambda d: _edit_file(d, F1, lambda t: t.update({"model.extra.weight": torch.ones(2)})),
                       ["unexpected", "model.extra.weight", F1]),
    "shape mismatch": (lambda d: _edit_file(d, F1, lambda t: t.update({k: torch.ones(3, 3) for k in list(t)[:1]})),
                       ["dtype/shape differs", "[3, 3]", F1]),
    "dtype kind": (lambda d: _edit_file(d, F1, lambda t: t.update({k: v.long() for k, v in list(t.items())[:1]})),
                   ["I64", F1, "a different kind"]),
    "malformed header": (lambda d: _flip(os.path.join(d, F2), 8), [F2, "not valid JSON"]),
    "file the index names is absent": (lambda d: os.remove(os.path.join(d, F2)), [F2, "missing"]),
    "index points at the wrong file": (_retarget, [F1, "which the index does not list for it"]),
    "data file is a FIFO": (lambda d: _replace(os.path.join(d, F2), os.mkfifo), [F2, "FIFO"]),
    "index is a FIFO": (lambda d: _replace(os.path.join(d, INDEX), os.mkfifo), [INDEX, "FIFO"]),
    "index is a directory": (lambda d: _replace(os.path.join(d, INDEX), os.mkdir), [INDEX, "a directory"]),
    "no model files": (lambda d: [os.remove(os.path.join(d, n)) for n in os.listdir(d) if "safetensors" in n],
                       ["expected model.safetensors"]),
}


@distributed(world_size=2)
def _bad_inputs(tmp: str) -> dict[str, str | None]:
    rank = dist.get_rank()
    good = os.path.join(tmp, "fp32-untied")
    results: dict[str, str | None] = {}
    for i, (name, (corrupt, _)) in enumerate(BAD.items()):
        case = os.path.join(tmp, f"case-{i}")
        if rank == 0:
            shutil.copytree(good, case)
            corrupt(case)
        dist.barrier()
        model = _sharded_llama(False, 0)
        before = {k: _full(v).clone() for k, v in model.state_dict().items()}
        try:
            load_hf(case, model, timeout=60)
            results[name] = None
        except CheckpointError as e:
            results[name] = str(e)
        for k, v in model.state_dict().items():
            assert torch.equal(_full(v), before[k]), f"{name}: {k} changed by a failed load"
    # strict=False: loads what matches, returns the rest (as load_state_dict).
    case = os.path.join(tmp, "lenient")
    if rank == 0:
        shutil.copytree(good, case)
        BAD["missing key"][0](case)
        BAD["unexpected key"][0](case)
    dist.barrier()
    model = _sharded_llama(False, 0)
    missing, unexpected = load_hf(case, model, strict=False)
    assert len(missing) == 1 and unexpected == ["model.extra.weight"], (missing, unexpected)
    return results


def test_bad_inputs_fail_on_every_rank(tmp_path: Path) -> None:
    _write_llama(str(tmp_path / "fp32-untied"), tie=False, dtype=torch.float32, shard_size="20KB")
    assert (tmp_path / "fp32-untied" / F2).exists()
    per_rank = _bad_inputs(str(tmp_path))
    assert_clear_errors(per_rank, {name: fragments for name, (_, fragments) in BAD.items()})
    for name in BAD:
        assert per_rank[0][name] == per_rank[1][name], name


# ------------------------------------------------------------------------------------------------------
# Single process: plain modules, key-map errors, sizes, file assignment.

def test_single_process_plain_model(tmp_path: Path) -> None:
    _write_llama(str(tmp_path / "m"), tie=True, dtype=torch.bfloat16, shard_size="20KB")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(_config(True))
    load_hf(tmp_path / "m", model)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    with torch.no_grad():
        assert (model(IDS).logits - ref(IDS).logits).abs().max() <= 1e-5
    save_hf(tmp_path / "out", model, dtype=torch.bfloat16, max_shard_size=10**9)
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    orig = {}
    for f in (tmp_path / "m").glob("*.safetensors"):
        orig.update(load_file(str(f)))
    assert sorted(back) == sorted(orig) and all(torch.equal(back[k], orig[k]) for k in orig)  # tied: written once
    (tmp_path / "file").write_text("precious")
    with pytest.raises(CheckpointError, match="not a directory"):
        save_hf(tmp_path / "file", model)
    assert (tmp_path / "file").read_text() == "precious"


def test_key_map_errors() -> None:
    with pytest.raises(CheckpointError, match="same number of"):
        KeyMap({"a.*": "b"})
    with pytest.raises(CheckpointError, match="exactly one '#'"):
        KeyMap(transforms=[Stack("w", "experts.*.w")])
    with pytest.raises(CheckpointError, match="at least 2"):
        KeyMap(transforms=[Fuse("qkv", ["q"])])
    # Load side: partners absent, experts with a gap, shapes that do not concatenate.
    km = KeyMap(transforms=[Fuse("qkv", ["q", "k", "v"]), Stack("w", "e.#.w")])
    got = km.resolve_load({"q": (2, 3), "k": (2, 4), "e.0.w": (2,), "e.2.w": (2,)}, {"qkv": (4, 3), "w": (3, 2)})
    assert any("absent: ['v']" in p for p in got.problems), got.problems
    assert any("absent: ['e.1.w']" in p for p in got.problems), got.problems
    # A transform that makes a tensor the model lacks: its sources are unexpected, not silently dropped.
    got = km.resolve_load({"q": (2, 3), "k": (2, 3), "v": (2, 3), "x": (1,)}, {"x": (1,)})
    assert got.unexpected == ["k", "q", "v"] and got.missing == [] and list(got.links) == ["x"], got
    # Save side: what cannot be inverted says how to fix it.
    with pytest.raises(CheckpointError, match="rename_inverse"):
        KeyMap(lambda n: n.removeprefix("model.")).resolve_save({"w": (2,)})
    assert KeyMap(lambda n: n.removeprefix("model."), rename_inverse=lambda n: "model." + n).resolve_save(
        {"w": (2,)}).shapes == {"model.w": (2,)}
    with pytest.raises(CheckpointError, match="sizes="):
        KeyMap(transforms=[Fuse("qkv", ["q", "k"])]).resolve_save({"qkv": (4, 3)})
    # Regex pairs rename in order; dict patterns invert.
    km = KeyMap([(r"^model\.", ""), (r"\.weight$", ".w")])
    assert km.resolve_load({"model.a.weight": (1,)}, {"a.w": (1,)}).links["a.w"][0].hf == "model.a.weight"
    km = KeyMap({"model.layers.*.attn": "blocks.*.attention"})
    assert km.rename("model.layers.3.attn") == "blocks.3.attention"
    assert km.rename_inverse is not None and km.rename_inverse("blocks.3.attention") == "model.layers.3.attn"


def test_max_shard_size_and_file_owners() -> None:
    assert hf_save.parse_size("5GB") == 5 * 10**9 and hf_save.parse_size("2GiB") == 2 << 30
    assert hf_save.parse_size(123) == 123
    for bad in ("5XB", 0, "-1MB", True):
        with pytest.raises(ValueError, match="max_shard_size"):
            hf_save.parse_size(bad)  # type: ignore[arg-type]
    groups = [hf_save._Group([f"m{i}"], [f"h{i}"], nbytes=10) for i in range(7)]
    files = hf_save._pack(groups, 25, 3)
    assert [len(f.groups) for f in files] == [2, 2, 2, 1]
    assert sorted({f.owner for f in files}) == [0, 1, 2]  # spread over ranks, not all on rank 0
    assert files[0].name == "model-00001-of-00004.safetensors"
