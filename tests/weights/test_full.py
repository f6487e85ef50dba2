"""iter_full and iter_local against the truth (DTensor's own ``full_tensor`` of every state_dict entry, or the
unsharded model), on every layout fully_shard makes: plain FSDP, uneven and 0-dim, Shard(1), ignored_params,
CPU offload, mixed precision, HSDP, TP 2-D, EP experts, key maps, LoRA merged. Collectives are counted at the
dispatcher and torch's allocations are profiled (design/weights.md states the bounds checked here)."""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from fully_shard import CPUOffloadPolicy, MixedPrecisionPolicy, QuantizedAllGather, fully_shard
from fully_shard.checkpoint import Fuse, KeyMap, Stack
from fully_shard.tools.memory import current_memory, peak_memory, reset_peak_memory
from fully_shard.tools.watch import CollectiveWatch
from fully_shard.weights import WeightSyncError, iter_full, iter_local, unshard
from tests.distributed.counting import CountCollectives
from tests.distributed.harness import distributed
from tests.weights.common import Odd, llama, same, shard_hf, train_step, truth


class _GatheredBytes(CollectiveWatch):
    """Bytes of the outputs of the all-gathers issued in the block."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def on_collective(self, op: str, args: tuple) -> None:
        if op == "_allgather_base_":
            self.n += args[0].numel() * args[0].element_size()


def _groups(model: nn.Module) -> list[Any]:
    return [u for u in unshard.units_of(model) if u.params]


@distributed(world_size=2)
def _llama_checks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tie in (True, False):
        ref = llama(tie)
        plain_keys = list(ref.state_dict())
        model = shard_hf(copy.deepcopy(ref))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(2):
            train_step(model, opt, step, 101)
        want = truth(model)
        got = dict(iter_full(model))
        names = [n for n, _ in iter_full(model)]
        assert len(names) == len(set(names)), names
        expected = [k for k in plain_keys if not (tie and k == "lm_head.weight")]  # tied: once, first name
        assert sorted(names) == sorted(expected), (names, expected)
        assert same(got, want) == [], same(got, want)
        bf16 = dict(iter_full(model, dtype=torch.bfloat16))
        assert same(bf16, truth(model, torch.bfloat16)) == []
        only = dict(iter_full(model, rank=1))
        if dist.get_rank() == 1:
            assert same(only, want) == []
        else:
            assert set(only) == set(want) and all(v is None for v in only.values())
        # one all-gather per unit group, none per parameter; the per-parameter loop: one per DTensor
        groups = _groups(model)
        with CountCollectives() as ours:
            for _ in iter_full(model):
                pass
        with CountCollectives() as loop:
            for _, v in model.state_dict().items():
                if isinstance(v, DTensor):
                    v.full_tensor()
        assert dict(ours.issued) == {"all_gather": len(groups)}, (ours.issued, len(groups))
        # a bf16 export of the fp32 weights casts before the wire: half the bytes gathered
        with _GatheredBytes() as fp32_bytes:
            for _ in iter_full(model):
                pass
        with _GatheredBytes() as bf16_bytes:
            for _ in iter_full(model, dtype=torch.bfloat16):
                pass
        assert 0 < bf16_bytes.n <= 0.55 * fp32_bytes.n, (bf16_bytes.n, fp32_bytes.n)
        dtensors = sum(isinstance(v, DTensor) for v in model.state_dict().values())
        gathers = sum(n for op, n in loop.issued.items() if "gather" in op)  # (funcol also issues wait_tensor)
        assert gathers == dtensors > len(groups), (loop.issued, dtensors)
        out[f"tie={tie}"] = len(groups)
    return out


def test_llama_names_values_and_collectives() -> None:
    results = _llama_checks()
    assert results[0] == results[1] == {"tie=True": 3, "tie=False": 3}


_M_MMAP_THRESHOLD = -3


@distributed(world_size=2)
def _peak_memory() -> list[float]:
    """Peak resident memory of one iter_full (its consumer dropping each tensor) beyond what the process held,
    over the largest unit's gathered bytes. glibc is told to map every block of 4 KiB or more on its own, so
    a freed block leaves the resident set at once and the peak is the live bytes' (to a page each)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(_M_MMAP_THRESHOLD, 4096)
    try:
        model = shard_hf(llama(False, hidden_size=256, intermediate_size=688, vocab_size=8192,
                               num_attention_heads=4, num_key_value_heads=4))
        train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), 0, 8192)
        largest = max(u.group.unsharded_nbytes for u in _groups(model))

        def consume() -> None:
            for _, t in iter_full(model):
                del t

        consume()  # (first-use allocations of the process out of the way)
        ratios = []
        for _ in range(2):
            before = current_memory()
            if not reset_peak_memory():
                pytest.skip("this kernel does not let a process reset its peak RSS (/proc/self/clear_refs)")
            consume()
            ratios.append((peak_memory() - before - _PAGES) / largest)
        return ratios
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024)


_PAGES = 512 * 1024  # page rounding and Python's own objects (a new 256 KiB arena now and then); 3% of the unit


def test_peak_memory_at_most_twice_the_largest_unit() -> None:
    for ratios in _peak_memory():
        assert all(0 < r <= 2.0 for r in ratios), ratios


def _odd(offload: bool, mp: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Odd()
    kw: dict[str, Any] = {}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model.b, shard_placement_fn=lambda p: Shard(1), **kw)
    fully_shard(model, ignored_params={model.pos}, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 5)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model


@distributed(world_size=3)
def _odd_layouts() -> None:
    for offload, mp in ((False, False), (True, False), (False, True)):
        model = _odd(offload, mp)
        want = truth(model)
        assert set(want) == {"a.weight", "a.bias", "b.weight", "scale", "pos", "stat"}
        for dtype in (None, torch.bfloat16, torch.float64):
            with CountCollectives() as c:
                got = dict(iter_full(model, dtype=dtype))
            assert same(got, {k: v.to(dtype) if dtype else v for k, v in want.items()}) == [], (offload, mp, dtype)
            # mixed precision to another dtype takes the fallback: still one all-gather per group
            assert dict(c.issued) == {"all_gather": 2}, (offload, mp, dtype, c.issued)
    # int8 all-gathers are lossy: iter_full gathers the shards themselves, exactly
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 8), nn.Linear(8, 3))
    want = truth(model)
    fully_shard(model, all_gather_policy=QuantizedAllGather(block_size=64))
    assert same(dict(iter_full(model)), want) == []


def test_uneven_zero_dim_shard1_ignored_offload_mixed_precision() -> None:
    _odd_layouts()


@distributed(world_size=3)
def _local_blocks() -> None:
    model = _odd(False, False)
    want = truth(model)
    shards = list(iter_local(model))
    assert [s.name for s in shards] == list(want)
    gathered: list[list[Any]] = [None] * 3  # type: ignore[list-item]
    dist.all_gather_object(gathered, [(s.name, s.offset, s.tensor.clone()) for s in shards])
    for s in shards:
        t = model.state_dict()[s.name]
        if isinstance(t, DTensor):
            assert s.placements == tuple(t.placements) and s.mesh is t.device_mesh
        else:
            assert s.placements == () and s.mesh is None and torch.equal(s.tensor, want[s.name])
        rebuilt = torch.full_like(want[s.name], float("nan"))
        for rank_shards in gathered:
            name, offset, block = next(x for x in rank_shards if x[0] == s.name)
            index = tuple(slice(o, o + n) for o, n in zip(offset, block.shape))
            rebuilt[index] = block
        assert torch.equal(rebuilt, want[s.name]), s.name


def test_iter_local_blocks_rebuild_the_full_tensors() -> None:
    _local_blocks()


class _Fused(nn.Module):
    """A fused qkv and stacked experts: what HF files keep as q/k/v and one tensor per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(6, 12, bias=False)  # q 6 rows, k 3, v 3
        self.experts = nn.Parameter(torch.randn(3, 6, 5))
        self.out = nn.Linear(6, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.qkv(x)[:, :6] + torch.einsum("td,edh->th", x, self.experts).sum(-1, keepdim=True))


@distributed(world_size=2)
def _key_map() -> None:
    torch.manual_seed(0)
    model = _Fused()
    fully_shard(model)
    want = truth(model)
    key_map = KeyMap({"o_proj.weight": "out.weight"}, transforms=[
        Fuse("qkv.weight", ["q.weight", "k.weight", "v.weight"], sizes=[6, 3, 3]),
        Stack("experts", "experts.#.w")])
    got = dict(iter_full(model, key_map=key_map, dtype=torch.float64))
    q, k, v = want["qkv.weight"].split([6, 3, 3])
    expected = {"q.weight": q, "k.weight": k, "v.weight": v, "o_proj.weight": want["out.weight"],
                **{f"experts.{e}.w": want["experts"][e] for e in range(3)}}
    assert same(got, {n: t.to(torch.float64) for n, t in expected.items()}) == []
    assert all(t.is_contiguous() for t in got.values())
    with pytest.raises(WeightSyncError, match="sizes"):
        iter_full(model, key_map=KeyMap(transforms=[Fuse("qkv.weight", ["q.weight", "k.weight"])]))
    # the renames load_hf/save_hf take: a bare dict (HF name -> model name), regex pairs and callables (each
    # with its inverse, as save_hf needs); names not renamed stay
    for key_map, names in (
            ({"o.w": "out.weight"}, {"qkv.weight": "qkv.weight", "experts": "experts", "o.w": "out.weight"}),
            (KeyMap([(r"^o_proj\.", "out.")], rename_inverse=[(r"^out\.", "o_proj.")]),
             {"qkv.weight": "qkv.weight", "experts": "experts", "o_proj.weight": "out.weight"}),
            (KeyMap(lambda n: n.removeprefix("hf_"), rename_inverse=lambda n: "hf_" + n),
             {"hf_qkv.weight": "qkv.weight", "hf_experts": "experts", "hf_out.weight": "out.weight"})):
        got = dict(iter_full(model, key_map=key_map))
        assert same(got, {hf: want[m] for hf, m in names.items()}) == [], (list(got), names)


def test_key_map_cuts_fused_and_unstacks_experts() -> None:
    _key_map()


@distributed(world_size=2)
def _wrapped() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    ref = llama(False)
    model = copy.deepcopy(ref)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(shard_hf(model))  # (never called: nothing compiles; its keys start with _orig_mod.)
    keys = list(compiled.state_dict())  # (torch's checkpoint_wrapper drops its own prefix there, on some versions)
    assert all(k.startswith("_orig_mod.") for k in keys), keys
    assert any("._checkpoint_wrapped_module." in n for n, _ in compiled.named_parameters())
    got = dict(iter_full(compiled))
    assert sorted(got) == sorted(ref.state_dict()), sorted(got)
    assert same(got, dict(ref.state_dict())) == []


def test_wrapper_prefixes_dropped() -> None:
    _wrapped()


@distributed(world_size=4)
def _hsdp_tp_ep() -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.parallel import moe_common as moe
    from tests.parallel import tp_common as tp

    counts: dict[str, Any] = {}
    # HSDP (2 replicas x 2 shards)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard_hf(llama(False), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt, 0, 101)
    with CountCollectives() as c:
        got = dict(iter_full(model))
    assert same(got, truth(model)) == []
    counts["hsdp"] = dict(c.issued), len(_groups(model))
    # TP 2-D (dp 2 x tp 2): one all-gather per group over dp, one more per group over tp
    torch.manual_seed(0)
    tp_model = tp.shard_2d(tp.tensor_parallel(tp.TPModel(gated=True), tp.mesh_2d()["tp"]), fully_shard,
                           tp.mesh_2d()["dp"])
    want = truth(tp_model)
    with CountCollectives() as c:
        got = dict(iter_full(tp_model))
    assert same(got, want) == []
    counts["tp"] = dict(c.issued), len(_groups(tp_model))
    # the unsharded model: the same values
    torch.manual_seed(0)
    assert same(got, truth(tp.TPModel(gated=True))) == []
    # EP experts (efsdp 2 x ep 2): (_StridedShard(0, sf=2), Shard(0)); dense on dp 4
    dense, efsdp, ep = moe.sparse_meshes(2, 2)
    torch.manual_seed(0)
    plain = moe.MoEModel()
    ep_model = moe.expert_parallel(copy.deepcopy(plain), ep)
    for layer in ep_model.layers:
        fully_shard(layer, mesh=dense, shard_placement_fn=lambda p: (
            fully_shard_placement(p, efsdp)))
    fully_shard(ep_model, mesh=dense)
    got = dict(iter_full(ep_model))
    assert same(got, truth(plain)) == []
    return counts


def fully_shard_placement(p: nn.Parameter, efsdp: Any) -> Any:
    from fully_shard import ShardPlacement
    from tests.parallel.moe_common import is_expert
    return ShardPlacement(Shard(0), mesh=efsdp) if is_expert(p) else None


def test_hsdp_tp_and_experts() -> None:
    counts = _hsdp_tp_ep()[0]
    ag, groups = counts["hsdp"]
    assert ag == {"all_gather": groups}, counts
    ag, groups = counts["tp"]
    assert ag["all_gather"] <= 2 * groups and set(ag) == {"all_gather"}, counts


@distributed(world_size=2)
def _lora() -> None:
    import peft
    base = llama(False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # (peft starts B at zero: a merge would change nothing)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    before = truth(model)
    got = dict(iter_full(model, merge_lora=True))
    assert list(got) == [k for k in merged if k != "lm_head.weight"] + ["lm_head.weight"] or \
        sorted(got) == sorted(merged), (list(got), list(merged))
    assert same(got, dict(merged)) == [], same(got, dict(merged))
    assert same(truth(model), before) == []  # the trainer's weights untouched
    assert "lora_A" in " ".join(dict(iter_full(model)))  # without merging: the peft model's own keys


def test_lora_merged_like_merge_and_unload() -> None:
    pytest.importorskip("peft")  # (the test extra has it)
    _lora()


@distributed(world_size=2)
def _errors() -> dict[str, str]:
    model = shard_hf(llama(True))
    found = {}
    for name, call in {
        "dtype": lambda: iter_full(model, dtype="bf16"),  # type: ignore[arg-type]
        "rank": lambda: iter_full(model, rank=5),
        "key_map": lambda: iter_full(model, key_map=[(r"^model\.", "")]),  # a regex rename: not invertible
    }.items():
        try:
            call()
            found[name] = "no error"
        except WeightSyncError as e:
            found[name] = str(e)
    with torch.device("meta"):
        meta = llama(True)
    try:
        iter_full(meta)
    except WeightSyncError as e:
        found["meta"] = str(e)
    return found


def test_bad_arguments_fail_on_every_rank_before_any_collective() -> None:
    for found in _errors():
        assert "torch.dtype" in found["dtype"] and "fix" in found["dtype"]
        assert "rank=5" in found["rank"]
        assert "key_map" in found["key_map"] and "rename_inverse" in found["key_map"]
        assert "meta device" in found["meta"] and "fix" in found["meta"]
