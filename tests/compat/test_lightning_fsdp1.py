"""Lightning's ``FSDPStrategy`` (its FSDP1 strategy) unchanged after ``compat.patch_torch(fsdp1=True)``, side by
side with the same run on torch's FSDP1 (CPU/gloo, 2 ranks, a tiny LightningModule, ``auto_wrap_policy={Block}``,
``use_orig_params=True``): the same per-step losses, and a sharded checkpoint (``trainer.save_checkpoint``: DCP
with ``FSDP.optim_state_dict``; ``fit(ckpt_path=...)``: DCP and ``optim_state_dict_to_load``) that a fresh
Trainer resumes from with the losses of the run that went on. (``state_dict_type="full"`` is not covered:
Lightning loads a full checkpoint into a model holding DTensors through ``set_model_state_dict`` per submodule,
which hangs with ours; a follow-up.) The sharded resume needed ``optim_state_dict_to_load`` to take the
``ShardedTensor`` optimizer state DCP's ``load_sharded_optimizer_state_dict`` gives.

What a GPU node would give Lightning and this CPU test sets by hand (``lightning_on_cpu``): Lightning refuses
``FSDPStrategy`` unless the accelerator is CUDA (``_AcceleratorConnector._check_strategy_and_fallback``), so that
one check is skipped for the run; and Lightning passes ``device_id=root_device.index``, a CUDA index on a GPU
node, ``None`` for the CPU device, which torch's FSDP1 refuses without a GPU ("FSDP needs a non-CPU accelerator
device"), so torch's run gets ``device_id=cpu`` in its place (``fsdp1_class(..., cpu_device_id=True)``). Ours
takes Lightning's ``None`` as it is. Everything else (wrapping, ``training_step`` / ``backward`` / ``step``,
the state-dict contexts, DCP save/load, the optimizer's state dict) is Lightning's own code."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.compat.frameworks import fsdp1_class
from tests.distributed.harness import distributed
from tests.wrap.common import shared_dir

pytest.importorskip("lightning", reason="lightning is in the test extra (pyproject)")

STEPS, SAVE_AT, BATCH = 5, 3, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _module() -> Any:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Linear(8, 16)
            self.blocks = nn.Sequential(Block(16), Block(16))
            self.head = nn.Linear(16, 1)
            self.losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.blocks(self.embed(x)))

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny()


def _data() -> Any:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2 * BATCH, 8, generator=g)  # one step per epoch (resuming mid-epoch replays the epoch)
    y = x.sum(dim=1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


@contextlib.contextmanager
def lightning_on_cpu() -> Generator[None, None, None]:
    """Lightning's CUDA-only check on ``FSDPStrategy`` skipped (see the module docstring); the environment
    variables Lightning's teardown removes (``WORLD_SIZE``) put back for the next run on these ranks."""
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    check = _AcceleratorConnector._check_strategy_and_fallback
    environ = dict(os.environ)

    def skip_cuda_check(self: Any) -> None:
        flag = self._strategy_flag
        self._accelerator_flag, accelerator = "cuda", self._accelerator_flag
        try:
            check(self)
        finally:
            self._accelerator_flag = accelerator
        assert self._strategy_flag is flag

    _AcceleratorConnector._check_strategy_and_fallback = skip_cuda_check  # type: ignore[method-assign]
    try:
        yield
    finally:
        _AcceleratorConnector._check_strategy_and_fallback = check  # type: ignore[method-assign]
        os.environ.clear()
        os.environ.update(environ)


def _trainer(kind: str, *, callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import FSDPStrategy

    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type=kind, use_orig_params=True,
                            process_group_backend="gloo")
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, plugins=[LightningEnvironment()],
                      max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks)


def _saver(path: str) -> Any:
    """Saves the checkpoint at the end of epoch ``SAVE_AT`` (one step per epoch), where ModelCheckpoint would."""
    import lightning.pytorch as pl

    class Saver(pl.Callback):
        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_step == SAVE_AT:
                trainer.save_checkpoint(path)

    return Saver()


@distributed(world_size=2, timeout=180)
def _run(variant: str, kind: str) -> dict[str, Any]:
    with lightning_on_cpu(), fsdp1_class(variant, cpu_device_id=True), shared_dir() as out:
        from torch.distributed.fsdp import FullyShardedDataParallel as Bound

        path = f"{out}/step{SAVE_AT}.ckpt"
        module, trainer = _module(), _trainer(kind, callbacks=[_saver(path)])
        trainer.fit(module, _data())
        wrapped = trainer.strategy.model
        home = next(c.__module__ for c in type(wrapped).__mro__ if c.__name__ == "FullyShardedDataParallel")
        wrapper = (home, isinstance(wrapped, Bound), len(Bound.fsdp_modules(wrapped)))
        resumed = _module()
        _trainer(kind, callbacks=[]).fit(resumed, _data(), ckpt_path=path)
    return {"losses": module.losses, "resumed": resumed.losses, "wrapper": wrapper}


def _check(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        print(f"\nLightning FSDPStrategy rank {rank}: losses {o['losses']} (torch {t['losses']}); "
              f"resumed {o['resumed']} (torch {t['resumed']})")
        assert o["wrapper"][0].startswith("fully_shard") and t["wrapper"][0].startswith("torch")
        assert o["wrapper"][1:] == t["wrapper"][1:] == (True, 3)  # the root + one unit per Block
        assert len(o["losses"]) == STEPS
        assert o["losses"] == t["losses"]  # bitwise, as ours and torch's FSDP1 are on CPU/gloo elsewhere
        assert o["resumed"] == o["losses"][SAVE_AT:], o  # the resumed run goes on exactly
        assert t["resumed"] == t["losses"][SAVE_AT:], t


def test_lightning_fsdp_strategy_sharded_checkpoint() -> None:
    _check(_run("ours", "sharded"), _run("torch", "sharded"))

