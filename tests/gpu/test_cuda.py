"""CUDA path: dedicated streams + events, storage freed on reshard, parity (NCCL, one GPU)."""

from __future__ import annotations

import copy
import json
import os
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fully_shard import MixedPrecisionPolicy
from tests.core.common import shard_gpt
from tests.distributed.harness import distributed
from tests.models import TinyGPT, batches, loss_fn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL on one GPU)"),
]


@distributed(world_size=1, backend="nccl")
def _parity_and_memory() -> dict[str, float]:
    torch.manual_seed(0)
    ref = TinyGPT().cuda()
    model = shard_gpt(copy.deepcopy(ref))
    assert model.tok.weight.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    worst = 0.0
    for x, y in batches(5):
        x, y = x.cuda(), y.cuda()
        loss = loss_fn(model(x), y)
        # between forward and backward the blocks' unsharded storage is freed (reshard_after_forward)
        for blk in model.blocks:
            assert all(p.to_local().untyped_storage().size() > 0 for p in blk.parameters())
            group = blk._fsdp.group
            assert all(sp._unsharded_write.untyped_storage().size() == 0 for sp in group.params)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_fn(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()))
    assert worst < 1e-4, worst  # TF32/cuBLAS may differ slightly between the two
    return {"max_loss_diff": worst}


def test_cuda_parity_and_freed_storage() -> None:
    _parity_and_memory()


@distributed(world_size=1, backend="nccl")
def _copy_in_on_side_stream() -> dict[str, object]:
    torch.manual_seed(0)
    model = shard_gpt(TinyGPT().cuda(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x, y = (t.cuda() for t in batches(1)[0])
    loss_fn(model(x), y).backward()  # lazy init + first step
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        loss_fn(model(x), y).backward()
        torch.cuda.synchronize()
    compute_stream = torch.cuda.current_stream().cuda_stream
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    gemm_streams = {e["args"]["stream"] for e in kernels if "gemm" in e["name"].lower() or "sm90" in e["name"]}
    cat_streams = {e["args"]["stream"] for e in kernels if "cat" in e["name"].lower()}
    # all-gather copy-in (a cat into the gathered buffer) runs on its own stream, not the compute one
    assert gemm_streams and cat_streams - gemm_streams, (gemm_streams, cat_streams)
    streams_by_kind = {"gemm": gemm_streams, "cat": cat_streams}
    ctx = model._fsdp.root.comm
    assert ctx.accelerated
    side = {ctx.all_gather_copy_in_stream.cuda_stream, ctx.all_gather_stream.cuda_stream,
            ctx.reduce_scatter_stream.cuda_stream}
    assert compute_stream not in side and len(side) == 3
    # the param dtype was bf16 in the all-gather: the gathered buffer is half the fp32 bytes
    group = model.blocks[0]._fsdp.group
    assert group.unsharded_nbytes == group.flat.total_numel * 2
    return {"streams": {k: sorted(v) for k, v in streams_by_kind.items()}, "compute": compute_stream}


def test_cuda_streams_are_dedicated() -> None:
    _copy_in_on_side_stream()
