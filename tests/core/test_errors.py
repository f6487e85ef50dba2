"""Bad input gets a clear error naming the module/parameter and the fix; nothing hangs."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from fully_shard import fully_shard
from fully_shard.parallel.mesh import MeshInfo
from tests.distributed.harness import distributed
from tests.models import TinyGPT


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # tied across two children


@distributed(world_size=2)
def _errors() -> None:
    lin = fully_shard(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"already applied to this Linear.*Fix: call fully_shard once"):
        fully_shard(lin)

    pair = Pair()
    fully_shard(pair.a)
    with pytest.raises(ValueError, match=r"'weight' of Linear is already managed by another fully_shard unit: "
                                         r"Linear \(param 'weight'\).*fully_shard\(\[a, b\]\)"):
        fully_shard(pair.b)

    with pytest.raises(ValueError, match=r"got a 3-D mesh of shape \(1, 1, 2\)"):
        fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, 1, 2)))

    with pytest.raises(ValueError, match=r"reshard_after_forward=3 must divide the shard group size 2"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=3)

    with pytest.raises(TypeError, match=r"expects nn.Module\(s\), got str"):
        fully_shard("model")  # type: ignore[arg-type]

    with pytest.raises(ValueError, match=r"returned Shard\(dim=2\) for 'weight' of shape \(4, 4\); expected "
                                         r"None or Shard\(d\) with -2 <= d < 2"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2))
    with pytest.raises(ValueError, match=r"returned Replicate\(\) for 'weight'"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate())

    with torch.device("meta"):
        meta_model = TinyGPT(n_blocks=1)
    for blk in meta_model.blocks:
        fully_shard(blk)
    fully_shard(meta_model)
    expected = r"still on the meta device: pos, tok.weight, blocks.0.gate, .*\(17 in all\). Fix: .*to_empty"
    with pytest.raises(RuntimeError, match=expected):
        meta_model(torch.zeros(1, 4, dtype=torch.long))


def test_bad_input_errors() -> None:
    _errors()


@distributed(world_size=2)
def _rank_mismatch() -> None:
    width = 4 if dist.get_rank() == 0 else 5  # a model built differently on rank 1
    with pytest.raises(RuntimeError, match=r"(?s)called differently across ranks.*-0.weight: \(4, 3\).*"
                       r"\+0.weight: \(5, 3\)"):  # at fully_shard() time, no collective in forward
        fully_shard(nn.Sequential(nn.Linear(3, width)))


def test_model_differing_across_ranks_fails_on_every_rank_without_hanging() -> None:
    _rank_mismatch()


@distributed(world_size=2)
def _mesh_too_large() -> None:
    fake = types.SimpleNamespace(ndim=1, shape=(4,), size=lambda dim=None: 4)
    with pytest.raises(ValueError, match=r"has 4 ranks but the world has 2.*init_device_mesh\(device, \(2,\)\)"):
        MeshInfo.of(fake)  # type: ignore[arg-type]


def test_mesh_world_size_mismatch() -> None:
    _mesh_too_large()


@distributed(world_size=2)
def _non_contiguous() -> None:
    torch.manual_seed(0)
    weight = torch.randn(5, 3).t()  # (3, 5), not contiguous
    assert not weight.is_contiguous()
    model = nn.Linear(5, 3, bias=False)
    model.weight = nn.Parameter(weight)
    fully_shard(model)
    x = torch.randn(2, 5)
    torch.testing.assert_close(model(x), x @ weight.T)


def test_non_contiguous_parameter_is_handled() -> None:
    _non_contiguous()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: parameters on cuda with a CPU mesh")
def test_mesh_device_type_differs_from_params() -> None:
    _device_mismatch()


@distributed(world_size=1)
def _device_mismatch() -> None:
    model = nn.Linear(4, 4).cuda()
    with pytest.raises(ValueError, match=r"'weight' is on cuda:0 but the mesh's device type is 'cpu'"):
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
