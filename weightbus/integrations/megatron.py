"""Trainer side: a Megatron-core model (TP, PP, EP, ETP) as a weight source, in Hugging
Face names.

mbridge (``pip install 'weightbus[megatron]'``) knows how each Megatron-core parameter maps
to Hugging Face names and how its tensor-parallel shards merge; we use its per-parameter
functions (``_weight_name_mapping_mcore_to_hf``, ``_weight_merge_across_tp``,
``_weight_to_hf_format``), not its ``export_weights``: that one all-gathers every TP shard
on every rank and broadcasts every parameter over the whole PP group, so every trainer rank
materialises the whole model. Here a Hugging Face tensor is assembled once, by one rank of
the group that holds it (the *leader*: tensor-parallel rank 0 of the first data-parallel
replica of its pipeline stage, or of its expert's owner), and sent only to the trainer ranks
that pack it (``owners(i)``, the engine's plan).

Every trainer rank iterates the source in the same order (the global catalogue built in the
constructor with one ``all_gather_object``): for each Megatron parameter, its holders
gather their shards to the leader (``gather`` over their TP/ETP group), the leader merges
and converts them, then sends each Hugging Face tensor to the owners that are not itself
(point to point over the trainer group). Ranks with no part in a tensor do nothing for it.

The engine's trainer ranks are the ranks of ``group`` (default: the world group): the
trainer ranks are the Megatron ranks.

Tested (``tests/test_megatron.py``, CPU, gloo, bitwise against mbridge's own export):
Qwen3 TP=2, Qwen2 PP=2, Qwen3-MoE EP=2 and TP=2 x EP=2 x ETP=1, with the local (non-TE)
layer spec, whose names this module maps to the TE spec's that mbridge expects. Not yet:
virtual pipelining, embeddings tied across pipeline stages, MoE expert biases, and owner
affinity (today a tensor whose leader does not pack it takes one extra point-to-point hop).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from weightbus.errors import PlanError
from weightbus.plan import Manifest, TensorMeta

_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


@dataclass(frozen=True)
class _Param:
    """One Megatron-core parameter, by its global name in mbridge's (TE-spec) naming."""

    name: str
    holders: tuple[int, ...]  # trainer ranks holding its shards, in TP (ETP) order
    shard_shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int  # -1: not tensor-parallel (every holder has it whole: the first sends)
    hf: tuple[TensorMeta, ...]  # what it becomes


def _unwrap(model: Any) -> torch.nn.Module:
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def _global_names(model: torch.nn.Module, experts_per_rank: int, ep_rank: int) -> dict[str, str]:
    """Local parameter name -> global name in mbridge's naming: decoder layers renumbered to
    the model's (PP and VPP), local-spec norms named as the TE spec fuses them, local experts
    ``local_experts.K.linear_fcX.weight`` as ``linear_fcX.weight{global K}``."""
    layer_of = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)} \
        if hasattr(model, "decoder") else {}
    out = {}
    local = {n for n, _ in model.named_parameters()}
    for name in local:
        g = name
        if name.endswith(".pre_mlp_layernorm.weight") and \
                name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.weight") in local:
            # a dense MLP: the TE spec fuses its norm into fc1
            g = g.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        g = g.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        m = re.search(r"decoder\.layers\.(\d+)\.", g)
        if m:
            g = g.replace(f"layers.{m.group(1)}.", f"layers.{layer_of[int(m.group(1))]}.", 1)
        e = _EXPERT.search(g)
        if e:
            expert = experts_per_rank * ep_rank + int(e.group(1))
            g = _EXPERT.sub(f"mlp.experts.{e.group(2)}.weight{expert}", g)
        out[name] = g
    return out


class MegatronSource:
    """Weights of Megatron-core model chunks (this rank's pipeline stage; several with
    virtual pipelining) in Hugging Face names, through an mbridge ``Bridge``.

    Args:
        models: this rank's model chunks (``DistributedDataParallel`` wrappers are unwrapped).
        bridge: an mbridge bridge for the model (``AutoBridge.from_config(hf_config)``).
        dtype: the wire dtype (default: each parameter's own).
        group: the trainer ranks' process group (default: the world).
    """

    def __init__(self, models: Sequence[Any], bridge: Any, *, dtype: torch.dtype | None = None,
                 group: Any = None):
        from megatron.core import parallel_state as ps

        self.models = [_unwrap(m) for m in models]
        self.bridge, self.group, self.dtype = bridge, group, dtype
        self.rank = dist.get_rank(group)
        n_experts = getattr(bridge.config, "num_moe_experts", None) or 0
        ep = ps.get_expert_model_parallel_world_size()
        self._tp_group = ps.get_tensor_model_parallel_group()
        self._etp_group = ps.get_expert_tensor_parallel_group() if n_experts else None
        me = {
            "rank": self.rank,
            "dp": ps.get_data_parallel_rank(with_context_parallel=True),
            "edp": ps.get_expert_data_parallel_rank() if n_experts else 0,
            "tp": ps.get_tensor_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank() if n_experts else 0,
            "params": [],
        }
        self._local: dict[str, torch.Tensor] = {}
        for model in self.models:
            names = _global_names(model, n_experts // max(ep, 1), ps.get_expert_model_parallel_rank())
            for local, p in model.named_parameters():
                g = names[local]
                self._local[g] = p
                me["params"].append((g, tuple(p.shape), p.dtype,
                                     p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1))
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, me, group=group)
        self._params = self._catalogue(everyone)
        self.manifest = Manifest([m for p in self._params for m in p.hf])

    def _catalogue(self, everyone: list[dict[str, Any]]) -> list[_Param]:
        """Every parameter once, in one order every rank computes alike: by pipeline stage
        (the order ranks report them in), then as each stage's first rank lists them."""
        seen: dict[str, list[tuple[dict[str, Any], tuple, torch.dtype, int]]] = {}
        order: list[str] = []
        for r in everyone:
            for name, shape, dtype, pdim in r["params"]:
                if name not in seen:
                    seen[name], _ = [], order.append(name)
                seen[name].append((r, shape, dtype, pdim))
        params = []
        for name in order:
            expert = ".mlp.experts.linear_fc" in name
            first = [x for x in seen[name] if (x[0]["edp"] if expert else x[0]["dp"]) == 0]
            by_tp = sorted(first, key=lambda x: x[0]["etp"] if expert else x[0]["tp"])
            _, shape, dtype, pdim = by_tp[0]
            holders = tuple(x[0]["rank"] for x in by_tp) if pdim >= 0 else (by_tp[0][0]["rank"],)
            meta = torch.empty(shape, dtype=dtype, device="meta")
            meta.tensor_model_parallel, meta.partition_dim = pdim >= 0, max(pdim, 0)  # type: ignore[attr-defined]
            merged = self.bridge._weight_merge_across_tp(name, [meta] * len(holders), meta) \
                if pdim >= 0 else meta
            hf_names, hf = self.bridge._weight_to_hf_format(name, merged)
            metas = tuple(TensorMeta(n, self.dtype or t.dtype, tuple(t.shape))
                          for n, t in zip(hf_names, hf, strict=True))
            params.append(_Param(name, holders, tuple(shape), dtype, pdim, metas))
        if not params:
            raise PlanError("MegatronSource: the model chunks hold no parameter")
        return params

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        everyone = frozenset(range(dist.get_world_size(self.group)))
        yield from self.iter_for(lambda i: everyone, self.rank)  # type: ignore[misc]

    def iter_for(self, owners: Callable[[int], frozenset[int]], rank: int,
                 into: Callable[[int], torch.Tensor | None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every tensor in manifest order; a rank not in ``owners(i)`` gets None for it."""
        i = 0
        with torch.no_grad():
            for p in self._params:
                want = frozenset().union(*(owners(i + k) for k in range(len(p.hf))))
                leader = p.holders[0]
                tensors: list[torch.Tensor] | None = None
                if rank in p.holders and (len(p.holders) > 1 or rank == leader):
                    tensors = self._assemble(p, leader)
                for k, meta in enumerate(p.hf):
                    t = tensors[k] if tensors is not None else None
                    if rank == leader:
                        t = t.to(meta.dtype).contiguous()  # type: ignore[union-attr]
                        for o in sorted(want - {leader}):
                            dist.send(t, dst=self._global(o), group=self.group)
                    elif rank in want:
                        t = torch.empty(meta.shape, dtype=meta.dtype, device=self._device())
                        dist.recv(t, src=self._global(leader), group=self.group)
                    yield meta.name, t if rank in owners(i + k) else None
                i += len(p.hf)

    def _global(self, rank: int) -> int:
        """``rank`` of ``group`` as torch.distributed's global rank (what send/recv take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _device(self) -> torch.device:
        return next(iter(self._local.values())).device

    def _assemble(self, p: _Param, leader: int) -> list[torch.Tensor] | None:
        """Holders: the shards gathered to the leader, merged and converted there."""
        mine = self._local[p.name].detach()
        if len(p.holders) > 1:
            group = self._etp_group if ".mlp.experts.linear_fc" in p.name else self._tp_group
            shards = [torch.empty_like(mine) for _ in p.holders] if self.rank == leader else None
            dist.gather(mine.contiguous(), shards, dst=self._global(leader), group=group)
            if self.rank != leader:
                return None
            merged = self.bridge._weight_merge_across_tp(p.name, shards, self._local[p.name])
        else:
            merged = mine
        _, hf = self.bridge._weight_to_hf_format(p.name, merged)
        return list(hf)

