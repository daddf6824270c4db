"""SGLang's conventions at toy size, for the CPU tests of weightbus's SGLang sink (SGLang
itself runs only on GPUs): a model whose ``load_weights`` maps checkpoint names onto fused
and tensor-parallel parameters the way SGLang's Qwen3 / Qwen3-MoE loaders do (``q/k/v``
stacked into ``qkv_proj`` by shard id, experts stacked into ``w13`` / ``w2`` by expert id,
each rank keeping its TP slice, a name it does not know logged and skipped), and the TP
worker processes an ``sglang.Engine`` drives, each calling weightbus's hook as SGLang's
``custom_weight_loader`` path does (``hook(model, named_tensors)``)."""

from __future__ import annotations

import logging
import re
import types

import torch
import torch.distributed as dist
from torch import nn

from weightbus.integrations.sglang.worker import HOOK, hook
from weightbus.runtime.group import LocalWorkerGroup, call

H, INTER, EXPERTS = 8, 16, 2


def default_loader(param, w):
    assert param.size() == w.size(), f"Attempted to load weight ({w.size()}) into parameter ({param.size()})"
    param.data.copy_(w)


class ToyModel(nn.Module):
    """Rank ``tp_rank`` of ``tp`` of a one-layer model with SGLang's parameter layout."""

    def __init__(self, tp_rank: int = 0, tp: int = 1):
        super().__init__()
        self.tp_rank, self.tp = tp_rank, tp
        self.config = types.SimpleNamespace(tie_word_embeddings=False)
        self.qkv_proj = nn.Parameter(torch.zeros(3 * H // tp, H), requires_grad=False)
        self.qkv_proj.weight_loader = self._qkv_loader
        self.o_proj = nn.Parameter(torch.zeros(H, H // tp), requires_grad=False)
        self.o_proj.weight_loader = self._row_loader
        self.norm = nn.Parameter(torch.zeros(H), requires_grad=False)  # default loader
        self.w13 = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER // tp, H), requires_grad=False)
        self.w13.weight_loader = self._expert_loader
        self.w2 = nn.Parameter(torch.zeros(EXPERTS, H, INTER // tp), requires_grad=False)
        self.w2.weight_loader = self._expert_loader

    def _qkv_loader(self, param, w, shard_id):
        rows = H // self.tp
        part = w.narrow(0, self.tp_rank * rows, rows)
        param.data.narrow(0, {"q": 0, "k": 1, "v": 2}[shard_id] * rows, rows).copy_(part)

    def _row_loader(self, param, w):
        cols = H // self.tp
        default_loader(param, w.narrow(1, self.tp_rank * cols, cols))

    def _expert_loader(self, param, w, name, shard_id, expert_id):
        size = INTER // self.tp
        if shard_id == "w2":
            param.data[expert_id].copy_(w.narrow(1, self.tp_rank * size, size))
        else:
            half = 0 if shard_id == "w1" else size
            param.data[expert_id].narrow(0, half, size).copy_(w.narrow(0, self.tp_rank * size, size))

    def load_weights(self, weights):
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]
        experts = {"gate_proj": ("w13", "w1"), "up_proj": ("w13", "w3"), "down_proj": ("w2", "w2")}
        params = dict(self.named_parameters())
        for name, w in weights:
            m = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", name)
            if m and m.group(2) in experts:
                pname, shard = experts[m.group(2)]
                params[pname].weight_loader(params[pname], w, name, shard_id=shard, expert_id=int(m.group(1)))
                continue
            for pname, wname, shard in stacked:
                if wname in name:
                    params[pname].weight_loader(params[pname], w, shard)
                    break
            else:
                key = name.removesuffix(".weight")
                if key in params:
                    getattr(params[key], "weight_loader", default_loader)(params[key], w)
                else:
                    logging.getLogger("toy").warning("Parameter %s not found in params_dict", name)


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors, as a checkpoint names them."""
    g = torch.Generator().manual_seed(seed)
    out = {f"{k}.weight": torch.randn(H, H, generator=g) for k in ("q_proj", "k_proj", "v_proj", "o_proj")}
    out["norm.weight"] = torch.randn(H, generator=g)
    for e in range(EXPERTS):
        out[f"experts.{e}.gate_proj.weight"] = torch.randn(INTER, H, generator=g)
        out[f"experts.{e}.up_proj.weight"] = torch.randn(INTER, H, generator=g)
        out[f"experts.{e}.down_proj.weight"] = torch.randn(H, INTER, generator=g)
    return out


class ToyTPWorker:
    """One TP rank of the toy engine (a process, as SGLang's schedulers are), in a default
    process group of the TP ranks (what SGLang sets up)."""

    def __init__(self, rank: int, world: int, port: int):
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.model = ToyModel(rank, world)

    def run_hook(self, named):
        hook(self.model, named)

    def params(self):
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


class ToyEngine:
    """What :class:`~weightbus.integrations.sglang.SGLangReplica` calls on an ``sglang.Engine``
    (its server args, ``update_weights_from_tensor`` with a custom loader, the weight
    version, the cache flush), over TP worker processes."""

    def __init__(self, tp: int, port: int, timeout: float = 120):
        ns = types.SimpleNamespace
        self.server_args = ns(tp_size=tp, pp_size=1, dp_size=1, custom_weight_loader=[HOOK])
        self.tokenizer_manager = ns(server_args=ns(weight_version="default"))
        self.workers = LocalWorkerGroup(ToyTPWorker, tp, port, name="toy-sglang")
        self.timeout = timeout
        self.flushes = 0

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        assert load_format == HOOK, load_format
        call(self.workers, "run_hook", list(named_tensors), timeout=self.timeout)
        if flush_cache:
            self.flushes += 1
        return True, "Success"

    def params(self, rank: int):
        return call(self.workers, "params", timeout=self.timeout)[rank]

    def shutdown(self):
        self.workers.shutdown()
