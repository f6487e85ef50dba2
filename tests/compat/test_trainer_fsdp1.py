"""transformers' ``Trainer`` on its FSDP1 path (``fsdp="full_shard auto_wrap"``, ``fsdp_config={"version": 1,
"transformer_layer_cls_to_wrap": [...]}``) unchanged after ``compat.patch_torch(fsdp1=True)``, side by side with the
same run on torch's FSDP1 (CPU/gloo, 2 ranks, a tiny Llama built from its config): the same per-step losses and
gradient norms; a run resumed from its step-2 checkpoint (``resume_from_checkpoint``: accelerate's
``load_fsdp_model`` / ``load_fsdp_optimizer``) logs what torch's resumed run logs (SHARDED_STATE_DICT) and, with
FULL_STATE_DICT (which torch's FSDP1 cannot save on CPU), the losses of the run that went on.

The Trainer enables FSDP only where accelerate does (accelerator process groups); ``_Trainer`` selects it on
CPU right after ``create_accelerator_and_postprocess`` (tests/compat/frameworks.py). ``sync_module_states`` is
off: accelerate's plugin refuses it on CPU before any FSDP class is called."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.compat.frameworks import fsdp1_class, reset_accelerate, select_fsdp
from tests.distributed.harness import distributed
from tests.wrap.common import rel_diffs, shared_dir

pytest.importorskip("accelerate", reason="accelerate is in the test extra (pyproject)")

STEPS, SAVE_AT = 4, 2


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    start = torch.randint(0, 96, (32, 1), generator=g)
    ids = (start + 5 * torch.arange(12)) % 96  # a learnable pattern
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(variant: str, out: str, kind: str) -> Any:
    from accelerate import FullyShardedDataParallelPlugin
    from transformers import Trainer, TrainingArguments

    class _Trainer(Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            select_fsdp(self.accelerator, FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args), variant=variant)
            self.is_fsdp_enabled = True

    reset_accelerate()
    args = TrainingArguments(
        output_dir=out, use_cpu=True, max_steps=STEPS, save_steps=SAVE_AT, save_strategy="steps", logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-2, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1.0, report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "state_dict_type": kind, "sync_module_states": "false"})
    return _Trainer(model=_model(), args=args, train_dataset=_data())


def _logged(trainer: Any) -> tuple[list[float], list[float]]:
    history = [h for h in trainer.state.log_history if "loss" in h]
    return [h["loss"] for h in history], [h["grad_norm"] for h in history]


@distributed(world_size=2, timeout=240)  # two Trainer runs (the first imports transformers' Trainer)
def _run(variant: str, kind: str) -> dict[str, Any]:
    with fsdp1_class(variant), shared_dir() as out:
        trainer = _trainer(variant, out, kind)
        trainer.train()
        losses, norms = _logged(trainer)
        from torch.distributed.fsdp import FullyShardedDataParallel as Bound

        wrapped = trainer.model_wrapped
        wrapper = (type(wrapped).__module__, type(wrapped) is Bound, len(Bound.fsdp_modules(wrapped)))
        dist.barrier()
        resumed = _trainer(variant, out, kind)
        resumed.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_AT}")
        after = _logged(resumed)[0][SAVE_AT:]  # (the log before the checkpoint comes back with it)
        reset_accelerate()
    return {"losses": losses, "norms": norms, "resumed": after, "wrapper": wrapper}


@functools.cache
def _torch_run() -> dict[str, Any]:
    result: dict[str, Any] = _run("torch", "SHARDED_STATE_DICT")[0]
    return result


def _same_training(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    print(f"\nTrainer FSDP1: losses {ours['losses']} (torch {theirs['losses']}); resumed from step {SAVE_AT}: "
          f"{ours['resumed']} (torch {theirs['resumed']})")
    assert ours["wrapper"][0].startswith("fully_shard") and theirs["wrapper"][0].startswith("torch")
    assert ours["wrapper"][1:] == theirs["wrapper"][1:] == (True, 3)  # the root + one unit per decoder layer
    assert len(ours["losses"]) == STEPS and rel_diffs(ours["losses"], theirs["losses"]) <= 1e-6
    assert rel_diffs(ours["norms"], theirs["norms"]) <= 2e-6


def test_trainer_fsdp1_sharded_checkpoint_resumes_as_torch() -> None:
    """SHARDED_STATE_DICT: the weights come back exactly (the first resumed loss); the optimizer's moments do
    not, in torch's run as in ours (accelerate loads DCP into the fresh optimizer's empty state dict), so the
    resumed run equals torch's resumed run."""
    ours, theirs = _run("ours", "SHARDED_STATE_DICT")[0], _torch_run()
    _same_training(ours, theirs)
    assert ours["resumed"][0] == ours["losses"][SAVE_AT] and theirs["resumed"][0] == theirs["losses"][SAVE_AT]
    assert rel_diffs(ours["resumed"], theirs["resumed"]) <= 1e-6


def test_trainer_fsdp1_full_checkpoint_resumes_exactly() -> None:
    """FULL_STATE_DICT, as accelerate asks for it with several ranks (``offload_to_cpu`` and ``rank0_only``,
    which torch's FSDP1 cannot do on CPU): model and optimizer come back whole, the resumed run logs the
    losses of the run that went on."""
    ours = _run("ours", "FULL_STATE_DICT")[0]
    _same_training(ours, _torch_run())
    assert ours["resumed"] == ours["losses"][SAVE_AT:], ours
