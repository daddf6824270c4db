"""What ``weightbus plan`` plans for: a cluster (nodes of GPUs, their links), where the
trainers and the rollouts sit on it, and the model (a preset, or a Hugging Face config's
tensor shapes).

Bandwidths are per GPU and per direction, in GB/s: ``nvlink_gbps`` is one GPU's NVLink
bandwidth to the other GPUs of its node, ``nic_gbps`` one NIC's (rail-aligned: GPU ``g`` of
a node uses NIC ``g % nics_per_node``), ``pcie_gbps`` the GPU's link to its host (what a
host-memory cache moves over), ``hbm_gbps`` the GPU's memory; ``host_mem_gib`` is a node's. They are the
hardware's nominal figures; :mod:`weightbus.planning.simulate` applies the efficiencies measured on
our own machines.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from weightbus.errors import PlanError
from weightbus.planning import presets


@dataclass(frozen=True)
class Cluster:
    """Identical nodes of GPUs. ``latency_us``: one hop's latency over a NIC (NVLink hops
    count ``nvlink_latency_us``)."""

    name: str
    nodes: int
    gpus_per_node: int
    nvlink_gbps: float
    nic_gbps: float
    nics_per_node: int
    hbm_gbps: float
    gpu_mem_gib: float
    latency_us: float = 10.0
    nvlink_latency_us: float = 3.0
    #: one GPU's PCIe link to its host (GB/s per direction), and a node's host memory
    pcie_gbps: float = 64.0
    host_mem_gib: float = 2048.0

    def __post_init__(self) -> None:
        for f in ("nodes", "gpus_per_node", "nics_per_node"):
            if int(getattr(self, f)) < (0 if f == "nics_per_node" else 1):
                raise PlanError(f"cluster {self.name!r}: {f} must be >= 1, got {getattr(self, f)}")
        for f in ("nvlink_gbps", "hbm_gbps", "gpu_mem_gib", "pcie_gbps", "host_mem_gib"):
            if not float(getattr(self, f)) > 0:
                raise PlanError(f"cluster {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if self.nodes > 1 and not (self.nic_gbps > 0 and self.nics_per_node >= 1):
            raise PlanError(f"cluster {self.name!r}: {self.nodes} nodes need NICs (nic_gbps > 0, "
                            f"nics_per_node >= 1)")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def nic_of(self, gpu: int) -> tuple[int, int]:
        """(node, NIC index) the GPU's traffic leaves its node by."""
        return self.node_of(gpu), (gpu % self.gpus_per_node) % max(1, self.nics_per_node)

    def with_nodes(self, nodes: int) -> Cluster:
        return dataclasses.replace(self, nodes=nodes)


#: nominal per-GPU figures of common nodes (GB/s per direction; NICs of 400 Gb/s)
CLUSTERS: dict[str, Cluster] = {
    "h100": Cluster("h100", 1, 8, nvlink_gbps=450, nic_gbps=50, nics_per_node=8, hbm_gbps=3350,
                    gpu_mem_gib=80),
    "h200": Cluster("h200", 1, 8, nvlink_gbps=450, nic_gbps=50, nics_per_node=8, hbm_gbps=4800,
                    gpu_mem_gib=141),
    # GH200 NVL2-less nodes of 4 superchips, one 400 Gb/s NIC each (the verl anchor's)
    "gh200": Cluster("gh200", 1, 4, nvlink_gbps=450, nic_gbps=50, nics_per_node=4, hbm_gbps=4000,
                     gpu_mem_gib=96, pcie_gbps=450, host_mem_gib=4 * 480),  # (NVLink-C2C to its Grace)
    # the machine our GPU rows were measured on: 2 H200s joined by NVLink, no NIC in use
    "h200x2": Cluster("h200x2", 1, 2, nvlink_gbps=450, nic_gbps=0, nics_per_node=0, hbm_gbps=4800,
                      gpu_mem_gib=141),
}


def cluster(name: str, nodes: int | None = None) -> Cluster:
    """A preset cluster (:data:`CLUSTERS`), with ``nodes`` nodes (default: its own)."""
    if name not in CLUSTERS:
        raise PlanError(f"unknown cluster {name!r}; choose from {', '.join(CLUSTERS)}")
    c = CLUSTERS[name]
    return c if nodes is None else c.with_nodes(nodes)


@dataclass(frozen=True)
class Layout:
    """Where the weights come from and go to.

    - ``trainers``: trainer GPUs; ``senders``: how many of them send (default: all, as
      FSDP ranks do; under Megatron the ranks of one data-parallel replica, ``tp*pp*ep``);
    - ``tp``, ``pp``, ``ep``: the trainers' Megatron parallelism (all 1: FSDP). Each
      pipeline stage then holds its own layers, each expert-parallel rank its own experts,
      and a tensor-parallel weight is split over its stage's ``tp`` ranks: the plan packs
      every bucket where its tensors are held (:attr:`Manifest.homes`);
    - ``replicas`` rollout replicas of ``rollout_gpus`` GPUs each (TP x EP);
    - ``colocated``: the rollouts share the trainers' GPUs (hybrid), else they sit on the
      GPUs after the trainers' (disaggregated).
    """

    trainers: int
    replicas: int
    rollout_gpus: int = 1
    senders: int | None = None
    colocated: bool = False
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in ("trainers", "replicas", "rollout_gpus", "tp", "pp", "ep"):
            if int(getattr(self, f)) < 1:
                raise PlanError(f"layout: {f} must be >= 1, got {getattr(self, f)}")
        if self.senders is not None and not 1 <= self.senders <= self.trainers:
            raise PlanError(f"layout: senders must be in [1, trainers={self.trainers}], got {self.senders}")
        if self.megatron:
            if self.trainers % (self.tp * self.pp * self.ep):
                raise PlanError(f"layout: {self.trainers} trainers are no whole number of Megatron replicas "
                                f"of tp*pp*ep = {self.tp}*{self.pp}*{self.ep}")
            if self.senders is not None and self.senders != self.tp * self.pp * self.ep:
                raise PlanError(f"layout: under Megatron the senders are one data-parallel replica, "
                                f"tp*pp*ep = {self.tp * self.pp * self.ep}; got senders={self.senders}")

    @property
    def megatron(self) -> bool:
        return self.tp * self.pp * self.ep > 1

    @property
    def rollouts(self) -> int:
        return self.replicas * self.rollout_gpus

    @property
    def n_senders(self) -> int:
        return self.tp * self.pp * self.ep if self.megatron else self.senders or self.trainers

    def sender_of(self, stage: int, ep_rank: int, tp_rank: int) -> int:
        """The sender index of a Megatron rank of the first data-parallel replica."""
        return (stage * self.ep + ep_rank) * self.tp + tp_rank

    def gpus_needed(self) -> int:
        return max(self.trainers, self.rollouts) if self.colocated else self.trainers + self.rollouts

    def rollout_gpu(self, r: int) -> int:
        return r if self.colocated else self.trainers + r

    def sender_gpu(self, s: int) -> int:
        if self.megatron:  # (Megatron's order: tp fastest, then ep and dp, then pp)
            stage, inside = divmod(s, self.ep * self.tp)
            return stage * (self.trainers // self.pp) + inside
        # (FSDP: senders spread over the trainers' nodes)
        return s * self.trainers // self.n_senders

    def check(self, c: Cluster) -> None:
        if self.gpus_needed() > c.gpus:
            raise PlanError(f"the layout needs {self.gpus_needed()} GPUs ({self.trainers} trainers, "
                            f"{self.replicas} x {self.rollout_gpus} rollouts"
                            f"{', colocated' if self.colocated else ''}); the cluster has {c.gpus} "
                            f"({c.nodes} x {c.gpus_per_node})")


# Architectures the planner knows beyond the presets' Qwen3 family (public HF config numbers)
MODELS: dict[str, dict] = {
    "qwen3-235b-a22b": {"hidden_size": 4096, "moe_intermediate_size": 1536, "num_experts": 128,
                        "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
                        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
    # DeepSeek-V3 layout (MLA attention, 1 shared + routed experts): Kimi-K2 is 1.04T params
    "kimi-k2": {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "num_hidden_layers": 61, "num_attention_heads": 64,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
                "tie_word_embeddings": False},
}


def model_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's (name, shape) of ``model``: a preset (``8b``, ``30b-a3b``...), a
    name of :data:`MODELS`, or a Hugging Face ``config.json`` (a file or a directory
    holding one) of the Qwen3 / Qwen3-MoE / Llama / DeepSeek-V3 families."""
    if model in presets.names():
        return presets.shapes(model)
    if model in MODELS:
        return config_shapes(MODELS[model])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if not os.path.isfile(path):
        raise PlanError(f"model {model!r} is no preset ({', '.join(presets.names())}), no known "
                        f"model ({', '.join(MODELS)}) and no config.json")
    with open(path) as f:
        return config_shapes(json.load(f))


def config_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor shapes of a Hugging Face config (decoder-only, Qwen/Llama or DeepSeek-V3)."""
    try:
        if c.get("model_type") in ("deepseek_v3", "kimi_k2") or "kv_lora_rank" in c:
            return _deepseek_shapes(c)
        c = dict(c)
        c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
        c.setdefault("num_key_value_heads", c["num_attention_heads"])
        c.setdefault("tie_word_embeddings", False)
        if "num_experts" not in c and "num_local_experts" in c:  # (Mixtral)
            c["num_experts"] = c["num_local_experts"]
            c["moe_intermediate_size"] = c["intermediate_size"]
        if "num_experts" in c and "moe_intermediate_size" not in c:
            c["moe_intermediate_size"] = c["intermediate_size"]
        return presets.config_shapes(c)
    except KeyError as e:
        raise PlanError(f"the model config lacks {e.args[0]!r} (a decoder-only Qwen/Llama/DeepSeek-V3 "
                        f"config is expected)") from None


def _deepseek_shapes(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_a_proj.weight", (c["q_lora_rank"], h)),
                (p + "self_attn.q_a_layernorm.weight", (c["q_lora_rank"],)),
                (p + "self_attn.q_b_proj.weight", (heads * qk, c["q_lora_rank"])),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h)),
                (p + "self_attn.kv_a_layernorm.weight", (c["kv_lora_rank"],)),
                (p + "self_attn.kv_b_proj.weight",
                 (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])),
                (p + "self_attn.o_proj.weight", (h, heads * c["v_head_dim"]))]
        if i < c["first_k_dense_replace"]:
            m = c["intermediate_size"]
            out += [(p + f"mlp.{n}.weight", s) for n, s in
                    (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m)))]
        else:
            m, e = c["moe_intermediate_size"], c["n_routed_experts"]
            out.append((p + "mlp.gate.weight", (e, h)))
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                out += [(q + "gate_proj.weight", (m, h)), (q + "up_proj.weight", (m, h)),
                        (q + "down_proj.weight", (h, m))]
            ms = m * c.get("n_shared_experts", 1)
            out += [(p + "mlp.shared_experts.gate_proj.weight", (ms, h)),
                    (p + "mlp.shared_experts.up_proj.weight", (ms, h)),
                    (p + "mlp.shared_experts.down_proj.weight", (h, ms))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab_size"], h))]
    return out
