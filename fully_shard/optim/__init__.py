"""Optimizers over sharded parameters: torch's optimizers stepping local shards, distributed Muon, clipping.

``step.py`` is the local-shard step (design/optimizer-step.md): a global optimizer step pre-hook hands
``step()`` a stand-in over this rank's shards (its cache and checks: ``cache.py``; torch's ``step()``
fed ready lists: ``lists.py``). Importing this package registers it with the core (``core/registry.py``).
``originals.py``: an optimizer built before the FSDP1 front end wrapped its module steps the sharded
parameters. ``muon.py``: ``Muon`` with owner-computed Newton-Schulz and ``muon_param_groups`` routing (design/muon.md;
its plan: ``muon_plan.py``). ``clip.py``: ``clip_grad_norm_`` over DTensor gradients on one or several meshes.
"""

from __future__ import annotations

from ..core import registry
from .cache import prove_grad
from .clip import clip_grad_norm_, total_grad_norm
from .muon import Muon, muon_param_groups
from .originals import keep_original, rebind_originals
from .step import StepPath, get_step_path, set_step_path, track

__all__ = ["Muon", "StepPath", "clip_grad_norm_", "get_step_path", "keep_original", "muon_param_groups",
           "rebind_originals", "set_step_path", "total_grad_norm"]

registry.on_sharded(track)  # every fully_shard call: its parameters, and the originals it replaced
registry.on_grad(prove_grad)  # every sharded gradient the reduce side makes carries the step's proof
