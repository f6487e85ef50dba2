"""4 ranks as threads of one process (torch's threaded process group, as torch's own tests use):
reshard_after_forward=2 creates k-rank subgroups per rank, not per process; training matches torch's
fully_shard run the same way. Runs in a subprocess with a hard timeout (the threaded group patches
torch.distributed process-wide)."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

WORLD = 4
_BUILD = threading.Lock()  # the threads share torch's global RNG: build one model at a time


def _train(fs: Any) -> dict[str, Any]:
    from tests.models import TinyGPT, batches, loss_fn
    with _BUILD:
        torch.manual_seed(0)
        model = TinyGPT(n_blocks=2, zero_dim=False)
    for blk in model.blocks:
        fs(blk, reshard_after_forward=2)
    fs(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, losses = dist.get_rank(), []
    for x, y in batches(3, batch=8):
        per = x.shape[0] // WORLD
        loss = loss_fn(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = model.blocks[0].__dict__.get("_fsdp_state")  # ours: the k=2 subgroup this rank gathers in
    subgroup = state.group.subgroup.group if state is not None else None
    return {"losses": losses, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
            "subgroup_ranks": dist.get_process_group_ranks(subgroup) if subgroup is not None else None}


def _rank_main(results: dict[int, Any]) -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fully_shard import fully_shard
    results[dist.get_rank()] = {"ours": _train(fully_shard), "torch": _train(torch_fully_shard)}


def main() -> None:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg
    mtpg._install_threaded_pg()  # what torch's spawn_threads_and_init_comms does
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(backend="threaded", rank=rank, world_size=WORLD, store=store)
            _rank_main(results)
        except BaseException as exc:
            errors[rank] = exc
            mtpg.ProcessLocalGroup.exception_handle(exc)  # wake the peers blocked in a collective
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    if errors:
        rank, err = sorted(errors.items())[0]
        raise RuntimeError(f"thread-rank {rank} failed") from err
    assert sorted(results) == list(range(WORLD)), f"thread-ranks that finished: {sorted(results)}"
    for rank, r in results.items():
        ours, ref = r["ours"], r["torch"]
        assert ours["subgroup_ranks"] == ([0, 1] if rank < 2 else [2, 3]), (rank, ours["subgroup_ranks"])
        assert max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"])) < 1e-6, (ours["losses"], ref["losses"])
        for name, p in ours["params"].items():
            torch.testing.assert_close(p, ref["params"][name], atol=1e-6, rtol=0)
    print("threaded ranks ok", results[0]["ours"]["losses"])


def test_reshard_after_forward_2_on_4_thread_ranks() -> None:
    done = subprocess.run([sys.executable, "-m", "tests.core.test_threaded_ranks"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "threaded ranks ok" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]


if __name__ == "__main__":
    main()
