"""torchao's subclasses through the all-gather extension, side by side with torch's fully_shard.

    pip install --no-deps --target /tmp/torchao_site torchao==0.18.0      # outside the project's venv
    PYTHONPATH=/tmp/torchao_site:$PWD python tests/manual/torchao_nf4.py           # NF4 QLoRA, 2 ranks
    PYTHONPATH=/tmp/torchao_site:$PWD python tests/manual/torchao_nf4.py --float8  # + Float8Linear

Not a CI test (torchao is not a dependency). NF4: a QLoRA-style model (frozen ``NF4Tensor`` base
weights from ``to_nf4``, trainable LoRA adapters, a plain head), one ``fully_shard`` per layer + the
root, trained with SGD on this rank's rows by this library and by torch's ``fully_shard`` from the same
weights and batches. Prints the losses of both, the largest gap in losses, LoRA gradients and weights
after the steps, and the all-gathers per forward. ``--float8``: torchao's ``convert_to_float8_training``
with ``enable_fsdp_float8_all_gather=True``, the same comparison (on a CPU, torchao's float8 matmul may
not run: the exact error is printed).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: fully_shard, tests

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fully_shard import fully_shard
from tests.distributed.counting import CountCollectives
from tests.distributed.launch import init, launch_if_needed


class NF4LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 8) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.weight = nn.Parameter(to_nf4(torch.randn(d_out, d_in) / math.sqrt(d_in)), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / math.sqrt(d_in))
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class Net(nn.Module):
    def __init__(self, layers: list[nn.Module], dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def nf4_net(dim: int) -> Net:
    return Net([NF4LoRALinear(dim, dim), NF4LoRALinear(dim, dim)], dim)


def float8_net(dim: int) -> Net:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    net = Net([nn.Linear(dim, dim), nn.Linear(dim, dim)], dim)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(net.layers, config=config)
    return net


HOOK_CALLS: list[tuple[str, ...]] = []


def instrument(model: nn.Module) -> list[str]:
    """Log every call of the all-gather hooks of the subclasses in ``model`` (the pre-hook's input dtypes,
    the post-hook's ``out=``); the wrappers keep the signatures (1- vs 5-argument detection)."""
    kinds = []
    for p in model.parameters():
        cls = type(p)
        if hasattr(cls, "fsdp_pre_all_gather") and not getattr(cls, "_logged", False):
            pre, post = cls.fsdp_pre_all_gather, cls.fsdp_post_all_gather

            @functools.wraps(pre)
            def pre_logged(self: Any, *args: Any, _pre: Any = pre, **kwargs: Any) -> Any:
                inputs, meta = _pre(self, *args, **kwargs)
                HOOK_CALLS.append(("pre", ",".join(str(t.dtype).replace("torch.", "") for t in inputs)))
                return inputs, meta

            @functools.wraps(post)
            def post_logged(self: Any, *args: Any, _post: Any = post, **kwargs: Any) -> Any:
                HOOK_CALLS.append(("post", "out" if kwargs.get("out") is not None else "new"))
                return _post(self, *args, **kwargs)

            pre_logged.__signature__ = inspect.signature(pre)  # type: ignore[attr-defined]
            cls.fsdp_pre_all_gather, cls.fsdp_post_all_gather = pre_logged, post_logged
            cls._logged = True
        if hasattr(cls, "fsdp_pre_all_gather"):
            kinds.append(cls.__name__)
    return sorted(set(kinds))


def summary(calls: list[tuple[str, ...]]) -> str:
    pre = sorted({c[1] for c in calls if c[0] == "pre"})
    posts = [c[1] for c in calls if c[0] == "post"]
    return (f"{sum(c[0] == 'pre' for c in calls)} pre-hook calls (inputs {pre}), post-hook {posts.count('new')} "
            f"new + {posts.count('out')} out=")


def train(fs: Callable[..., Any], make: Callable[[], Net], steps: int, dim: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make()
    kinds = instrument(model)
    HOOK_CALLS.clear()
    for layer in model.layers:
        fs(layer)
    fs(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, dim, generator=g), torch.randn(8, dim, generator=g)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    out: dict[str, Any] = {"losses": [], "ag": []}
    for i in range(steps):
        with CountCollectives() as fwd:
            loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        loss.backward()
        if i == 0:
            out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out["losses"].append(t.item() / world)
        out["ag"].append(fwd.counts.get("all_gather", 0))
    out["hooks"] = f"{kinds}: {summary(HOOK_CALLS)}"
    out["trained"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out


def compare(name: str, make: Callable[[], Net], steps: int, dim: int) -> None:
    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for lib, fs in (("ours", fully_shard), ("torch", torch_fully_shard)):
        try:
            results[lib] = train(fs, make, steps, dim)
        except Exception as exc:
            last = traceback.format_exc().strip().splitlines()[-1]
            results[lib] = None
            if rank == 0:
                print(f"{name} [{lib}]: FAILED: {type(exc).__name__}: {last}")
    ours, ref = results.get("ours"), results.get("torch")
    if rank != 0:
        return
    for lib in ("ours", "torch"):
        if results.get(lib) is not None:
            r = results[lib]
            print(f"{name} [{lib}] losses: {' '.join(f'{v:.6f}' for v in r['losses'])}; all-gathers per forward: "
                  f"{r['ag']}; {r['hooks']}")
    if ours is not None and ref is not None:
        loss_gap = max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))
        grad_gap = max((ours["grads"][n] - ref["grads"][n]).abs().max().item() for n in ref["grads"])
        w_gap = max((ours["trained"][n] - ref["trained"][n]).abs().max().item() for n in ref["trained"])
        print(f"{name}: max |loss gap| {loss_gap:.2e}, max |grad gap| (step 1, {len(ref['grads'])} grads) "
              f"{grad_gap:.2e}, max |trained weight gap| after {steps} steps {w_gap:.2e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--float8", action="store_true")
    args = ap.parse_args()
    launch_if_needed(__file__, 2)
    init("gloo")
    compare("NF4 QLoRA", lambda: nf4_net(args.dim), args.steps, args.dim)
    if args.float8:
        compare("Float8Linear (float8 all-gather)", lambda: float8_net(args.dim), args.steps, args.dim)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
