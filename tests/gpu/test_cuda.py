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

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL on one GPU)")


# GEMM kernel names, as benchmarks/gpu_check.py's analyze_kernels reads them: cuBLAS ("gemm"), Hopper's sm90
# and cuBLASLt "nvjet_*" kernels, CUTLASS, and the attention kernels, which run on the compute stream too
_GEMM_NAMES = ("gemm", "sm90", "cutlass", "nvjet", "flash", "fmha")


def _is_gemm(name: str) -> bool:
    lowered = name.lower()
    return any(part in lowered for part in _GEMM_NAMES)


def test_gemm_names_include_hopper_kernels() -> None:
    """Runs on CPU: kernel names as torch.profiler reports them on an H100/H200 (cuBLASLt's nvjet_*,
    sm90 cuBLAS, CUTLASS) and on Ampere count as GEMMs; the all-gather copy-in's cat kernel does not."""
    gemms = ["nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "nvjet_tss_64x8_64x16_2x1_v_bz_splitK_TNT",
             "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
             "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(T1::Params)",
             "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn"]
    assert all(_is_gemm(n) for n in gemms), [n for n in gemms if not _is_gemm(n)]
    assert not _is_gemm("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous "
                        "namespace)::OpaqueType<2u>, unsigned int, 1, 128, 1>(...)")


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


@pytest.mark.gpu
@_needs_cuda
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
    gemm_streams = {e["args"]["stream"] for e in kernels if _is_gemm(e["name"])}
    cat_streams = {e["args"]["stream"] for e in kernels if "cat" in e["name"].lower()}
    # all-gather copy-in (a cat into the gathered buffer) runs on its own stream, not the compute one
    assert gemm_streams and cat_streams - gemm_streams, (gemm_streams, cat_streams)
    streams_by_kind = {"gemm": gemm_streams, "cat": cat_streams}
    ctx = model._fsdp.root.ctx
    assert ctx.accelerated
    side = {ctx.all_gather_copy_in_stream.cuda_stream, ctx.all_gather_stream.cuda_stream,
            ctx.reduce_scatter_stream.cuda_stream}
    assert compute_stream not in side and len(side) == 3
    # the param dtype was bf16 in the all-gather: the gathered buffer is half the fp32 bytes
    group = model.blocks[0]._fsdp.group
    assert group.unsharded_nbytes == group.flat.total_numel * 2
    return {"streams": {k: sorted(v) for k, v in streams_by_kind.items()}, "compute": compute_stream}


@pytest.mark.gpu
@_needs_cuda
def test_cuda_streams_are_dedicated() -> None:
    _copy_in_on_side_stream()
