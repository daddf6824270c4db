"""Trainer side: a Megatron-core model (TP, PP, EP, ETP) as a weight source, in Hugging
Face names.

mbridge (``pip install 'weightbus[megatron]'``) knows how each Megatron-core parameter maps
to Hugging Face names and how its tensor-parallel shards merge; we use its per-parameter
functions (``_weight_name_mapping_mcore_to_hf``, ``_weight_merge_across_tp``,
``_weight_to_hf_format``), not its ``export_weights``: that one all-gathers every TP shard
on every rank and broadcasts every parameter over the whole PP group, so every trainer rank
materialises the whole model. Here a Hugging Face tensor is made only where it is packed.

The manifest says where each tensor is held (:attr:`Manifest.homes`): a parameter split
over tensor parallelism by the ranks of its TP (ETP) group in the first data-parallel
replica, one held whole by every rank that has it (every DP replica, every TP rank of its
stage; an expert by its EP rank's replicas). The engine's plan then has every bucket packed
by a rank that holds all of its tensors: each pipeline stage packs its own layers, each EP
rank its own experts, and the TP ranks of a stage share its buckets. For each Megatron
parameter, in one order every rank computes alike (the catalogue, built in the constructor
with one ``all_gather_object``), a split one's holders gather their shards (``gather``
over their TP/ETP group) to a holder that packs it, which merges and converts them; a whole
one is converted from each packer's own copy. Ranks with no part in a tensor do nothing for
it. A tensor goes point to point to a packer that cannot make it itself only where a bucket
boundary falls between the Hugging Face tensors of one parameter (``hops`` counts those
bytes), or under an engine whose plan ignores homes.

The engine's trainer ranks are the ranks of ``group`` (default: the world group): the
trainer ranks are the Megatron ranks.

Tested (``tests/test_megatron.py``, CPU, gloo, bitwise against mbridge's own export):
Qwen3 TP=2, Qwen2 PP=2 (also with virtual pipelining), Qwen3 PP=2 with embeddings tied
across the stages (the first stage's embedding is sent; the last stage's copy of it is
not), Qwen3-MoE EP=2 and TP=2 x EP=2 x ETP=1, with the local (non-TE) layer spec, whose
names this module maps to the TE spec's that mbridge expects; on one GPU, colocated.
Not yet: MoE expert biases (``expert_bias`` lives in the state dict, not among the
parameters).
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
    #: split over tensor parallelism: the ranks holding its shards (the first data-parallel
    #: replica's TP or ETP group), in TP order; empty when ranks hold it whole
    holders: tuple[int, ...]
    #: ranks that can produce its Hugging Face tensors with no help: the holders when it is
    #: split (one of them gathers), else every rank holding it whole (any DP replica)
    homes: frozenset[int]
    dtype: torch.dtype
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
        #: bytes this rank sent to another trainer rank because that one packs a tensor
        #: it cannot make itself (zero under a plan that follows the manifest's homes,
        #: but where a bucket boundary falls inside one parameter's tensors)
        self.hops = 0
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
        # where each tensor is held: the engine's plan then has every bucket packed by a
        # rank that holds (or gathers) its tensors, so none takes an extra hop to its packer
        # (and a fused parameter's tensors, made together, are best packed together)
        self.manifest = Manifest([m for p in self._params for m in p.hf],
                                 homes=[p.homes for p in self._params for _ in p.hf],
                                 units=[k for k, p in enumerate(self._params) for _ in p.hf])

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
        named: dict[str, str] = {}  # Hugging Face name -> the parameter that gives it
        for name in order:
            expert = ".mlp.experts.linear_fc" in name
            first = [x for x in seen[name] if (x[0]["edp"] if expert else x[0]["dp"]) == 0]
            by_tp = sorted(first, key=lambda x: x[0]["etp"] if expert else x[0]["tp"])
            _, shape, dtype, pdim = by_tp[0]
            holders = tuple(x[0]["rank"] for x in by_tp) if pdim >= 0 and len(by_tp) > 1 else ()
            homes = frozenset(holders or (x[0]["rank"] for x in seen[name]))
            meta = torch.empty(shape, dtype=dtype, device="meta")
            meta.tensor_model_parallel, meta.partition_dim = pdim >= 0, max(pdim, 0)  # type: ignore[attr-defined]
            merged = self.bridge._weight_merge_across_tp(name, [meta] * len(by_tp), meta) \
                if pdim >= 0 else meta
            hf_names, hf = self.bridge._weight_to_hf_format(name, merged)
            again = [n for n in hf_names if n in named]
            if again:
                # embeddings tied across pipeline stages: the last stage's output layer is a
                # copy of the first stage's embedding (Megatron keeps them equal), and the
                # bridge names both model.embed_tokens.weight: the first one sends it
                if len(again) != len(hf_names):
                    rest = sorted(set(hf_names) - set(again))
                    raise PlanError(f"MegatronSource: {name!r} gives {again}, which "
                                    f"{named[again[0]]!r} gives too, and also {rest}")
                continue
            named.update((n, name) for n in hf_names)
            metas = tuple(TensorMeta(n, self.dtype or t.dtype, tuple(t.shape))
                          for n, t in zip(hf_names, hf, strict=True))
            params.append(_Param(name, holders, homes, dtype, metas))
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
                if p.holders:  # split: one holder gathers it, one that packs it if any does
                    mine = want & set(p.holders)
                    sender = min(mine) if mine else p.holders[0]
                    have = {sender}
                else:  # held whole: every home that packs it uses its own copy
                    sender, have = min(p.homes), want & p.homes
                    if want - have:
                        have = have | {sender}
                tensors: list[torch.Tensor] | None = None
                if rank in p.holders or rank in have:
                    tensors = self._assemble(p, sender)
                for k, meta in enumerate(p.hf):
                    mine = rank in owners(i + k)
                    t = tensors[k] if tensors is not None else None
                    if t is not None and (mine or rank == sender):  # (cast only what is used)
                        t = t.to(meta.dtype).contiguous()
                    if rank == sender:  # to the packers that cannot make it themselves
                        for o in sorted(want - have):
                            dist.send(t, dst=self._global(o), group=self.group)  # type: ignore[arg-type]
                            self.hops += t.nbytes  # type: ignore[union-attr]
                    elif rank in want - have:
                        t = torch.empty(meta.shape, dtype=meta.dtype, device=self._device())
                        dist.recv(t, src=self._global(sender), group=self.group)
                    yield meta.name, t if mine else None
                i += len(p.hf)

    def _global(self, rank: int) -> int:
        """``rank`` of ``group`` as torch.distributed's global rank (what send/recv take)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _device(self) -> torch.device:
        return next(iter(self._local.values())).device

    def _assemble(self, p: _Param, leader: int) -> list[torch.Tensor] | None:
        """``p``'s Hugging Face tensors: a split one's shards gathered to the leader (None on
        the other holders) and merged there; a whole one converted from this rank's copy."""
        mine = self._local[p.name].detach()
        if p.holders:
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

