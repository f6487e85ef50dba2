"""Optimizers for fully_shard's sharded parameters: distributed Muon (+ AdamW routing)."""

from __future__ import annotations

from .muon import Muon, muon_param_groups

__all__ = ["Muon", "muon_param_groups"]
