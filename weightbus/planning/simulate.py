"""What a weight sync would take on a cluster we do not have (``weightbus plan``).

The schedule is the engines' own: :class:`~weightbus.plan.BucketPlan` says which sender
packs which bucket (broadcast, chains, mooncake's reads), :meth:`ShardLayout.wants` and
:meth:`ShardPlan._senders` which regions each rollout rank takes and which sender sends
each tensor (sharded receive), :func:`weightbus.planning.topology.choose` and ``layout`` the
trees ``nixl`` forwards along, :func:`weightbus.engines.delta.record_bytes` what a delta
update's records weigh. Each backend's schedule is one function (``_schedule``); what is
simulated is how its bytes cross the links:

- every transfer is put on the links it crosses (an NVLink port out and in inside a node,
  a NIC out and in between nodes, rail-aligned; a GPU's PCIe link to its host), and
  concurrent transfers share a link, so its load is the sum of what crosses it (a fluid
  model: contention is bytes adding up on the busiest link, which is what bounds a
  pipelined schedule);
- the update takes the busiest link's load at its rate (nominal x the efficiency measured
  on our machines), plus what does not overlap with it: the pipeline's fill (a relay
  forwards a bucket once it has it, so each hop of a chain adds a bucket), the first
  bucket's pack and the last one's unpack, a per-tensor host cost, per-bucket
  handshakes and a fixed per-update cost (the header and the agreed outcome); copies on
  one GPU (colocated) and FSDP gathers are priced by the same measured rates;
- work on either side is added where it does not overlap: fp8 quantization, a delta
  update's diff, its patches applied, and the receivers' whole-destination check (what the
  trainers' diff does not hide: it reads the destinations while they diff).

:data:`CALIBRATION` holds every constant, each measured on our GPUs (benchmarks/RESULTS.md
names the rows; ``tests/test_simulate.py`` holds the simulator within 15% of them).
NIC and PCIe figures are not measured here (our machines have none in use): ``nic_eff``
and ``pcie_eff`` are assumptions, and rows across nodes are predictions, not calibrated ones.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from weightbus.errors import PlanError
from weightbus.packing.shards import Box, ShardLayout, ShardPlan, chunk_box
from weightbus.plan import BucketPlan, Manifest, TensorMeta
from weightbus.planning import topology
from weightbus.planning.cluster import Cluster, Layout

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Calibration:
    """Rates and costs measured on our machines (see the module doc; the rows are in
    benchmarks/RESULTS.md, "The planner", each with the command that measured it)."""

    #: NCCL's broadcast over NVLink: 368 of 450 GB/s (2xH200, a raw broadcast of 16-65 GB)
    nvlink_eff: float = 0.817
    #: the engines' transfers run beside their packs and unpacks on the same GPUs (HBM
    #: shared): 4.6% slower than the raw link (the 0.6b and 8b broadcast rows)
    overlap_x: float = 1.046
    #: an all-gather over NVLink (FSDP2 gathering into the rollout's tensors): 252 of 450
    allgather_eff: float = 0.56
    #: one all-gather call's least time (a tensor gathered on its own: 4,719 of them took
    #: 244 ms against 33 ms for their bytes in bulk, benchmarks/gather_each.py)
    gather_call_s: float = 50e-6
    #: assumed, not measured: a 400 Gb/s NIC's share NCCL and NIXL reach
    nic_eff: float = 0.90
    #: one bulk cast-copy on a GPU (H200: 14.8 ms for 62.4 GB read + written)
    hbm_eff: float = 0.88
    #: the multi-tensor copy of tensors under 16 MiB, x the bulk copy's time (bf16, fp32 src)
    small_copy_x: tuple[float, float] = (1.65, 1.25)
    #: colocated direct mode, a same-dtype copy: one Triton launch over a chunk table of every
    #: tensor, x the bulk copy's time (30b-a3b/24 on an H200: 15.8 ms against 15.0, round
    #: eight); the ring's packs use the same kernel, but its constants (the copy above, the
    #: per-bucket stall) still fit its rows measured before its slots signalled with events
    direct_copy_x: float = 1.05
    #: the same kernel's float32 -> bfloat16 cast, x one bulk cast (30b-a3b/24 on an H200:
    #: 23.6 ms against 21.5, round nine; torch's multi-tensor cast took 1.46x)
    direct_cast_x: float = 1.10
    #: the block-fp8 kernel (84% of an H200's HBM) and the host's cost per quantized tensor
    quant_eff: float = 0.84
    quant_tensor_s: float = 0.52e-6
    #: delta mode: the trainer's diff and encode, x a bulk pass over the bytes it reads and
    #: writes, fitted to 8b end to end on 2 x H200 (its kernels and host alone take 16-20 ms
    #: of an H200, round ten; end to end, the rounds' waits on each other add to it); the
    #: receiver's apply, in bulk reads of the dense bytes,
    #: at (fraction changed, x) from the delta kernels' table (8b at 2%: 9.9 ms); the
    #: whole-destination check, x a bulk read (8b on an H200: 4.7-5.1 ms, round ten; it runs
    #: beside the trainers' diff)
    diff_eff: float = 0.39
    apply_x: tuple[tuple[float, float], ...] = ((0.0, 0.0), (0.02, 2.9), (0.1, 17.9), (0.3, 25.9))
    verify_eff: float = 0.70
    #: per update (header, manifest, agreed outcome), per tensor (host walk), per bucket
    fixed_s: float = 2.4e-3
    tensor_s: float = 0.15e-6
    colocated_fixed_s: float = 3.0e-3
    ring_bucket_s: float = 0.58e-3  # the colocated ring's per-bucket stream sync + handshake
    group_s: float = 0.05e-3  # FSDP direct: a 256 MiB gather group's launch and wait
    #: assumed, not measured: the share of PCIe a host-memory cache's copies reach
    pcie_eff: float = 0.80
    #: colocated: per tensor, the bulk checks only (no per-tensor walk on either side)
    colocated_tensor_s: float = 0.055e-6
    #: sharded receive: a piece's cost on its sender's host (its place in the bucket's
    #: copy list, the views cut once per plan), in series with nothing else the sender
    #: does: 30b-a3b/24 at TP=3 on 4 H100s, 28,305 pieces from one sender, took 98-100 ms
    #: where its bytes take 84 ms sent point to point (it was 6.9e-6 while every piece was
    #: cut anew at every update: 196-204 ms)
    piece_s: float = 3.4e-6


CALIBRATION = Calibration()

@dataclass
class Prediction:
    """One backend's simulated update. Bytes are GB (1e9), memory GiB per GPU."""

    backend: str
    seconds: float
    floor_s: float
    bottleneck: str
    nic_gb: float  # the busiest NIC's bytes (one direction)
    nvlink_gb: float  # the busiest NVLink port's bytes
    rollout_gb: float  # bytes the busiest rollout GPU receives
    peak_extra_gib: float  # extra GPU memory the update holds (buckets, fp8 payloads, snapshots)
    buckets: int
    bucket_size: int = 0
    parts: dict[str, float] = field(default_factory=dict)
    #: the busiest links: (link, GB, seconds at its rate), busiest first
    links: list[tuple[str, float, float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: what would move, per rank and per link: GB each sender sends (sender order), each
    #: rollout GPU receives (replica by replica), and every link carries (one direction)
    sent_gb: list[float] = field(default_factory=list)
    received_gb: list[float] = field(default_factory=list)
    link_gb: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.seconds / self.floor_s if self.floor_s > 0 else math.inf


# --- the model's tensors as they travel -------------------------------------------------------
def served_fp8(name: str, shape: Sequence[int]) -> bool:
    """Weights an fp8 rollout serves quantized (a Qwen3/DeepSeek FP8 checkpoint's): every
    linear weight but the embeddings, the head and the MoE router."""
    return len(shape) == 2 and "embed_tokens" not in name and "lm_head" not in name \
        and not name.endswith("mlp.gate.weight")


def manifest_of(shapes: Iterable[tuple[str, Sequence[int]]], *, fp8: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> Manifest:
    """The update's manifest: every tensor in ``dtype``; with ``fp8`` the served weights as
    e4m3 payloads each followed by its 128x128 block scale (``QuantizedSource``'s layout)."""
    metas: list[TensorMeta] = []
    for name, shape in shapes:
        shape = tuple(int(s) for s in shape)
        if fp8 and served_fp8(name, shape):
            metas.append(TensorMeta(name, torch.float8_e4m3fn, shape))
            metas.append(TensorMeta(name + "_scale_inv", torch.float32,
                                    (-(-shape[0] // 128), -(-shape[1] // 128))))
        else:
            metas.append(TensorMeta(name, dtype, shape))
    return Manifest(metas)


# --- which rollout rank keeps what --------------------------------------------------------------
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "w2")


def rollout_layouts(manifest: Manifest, gpus: int) -> list[ShardLayout]:
    """The regions each of a replica's ``gpus`` ranks keeps, as vLLM/SGLang shard a decoder:
    experts whole to their expert-parallel rank (``e % gpus``), row-parallel weights
    (``o_proj``, ``down_proj``) split along columns, every other matrix (q/k/v, gate/up,
    the vocab) along rows, vectors (norms) and scales replicated."""
    layouts: list[dict[str, list[Box]]] = [{} for _ in range(gpus)]
    none: list[Box] = []  # (shared: a trillion-parameter MoE lists each expert on every rank)
    for m in manifest.metas:
        if gpus == 1 or len(m.shape) != 2 or m.name.endswith(("_scale_inv", "_scale")):
            continue
        expert = _expert_index(m.name)
        if expert is not None:
            for held in layouts:
                held[m.name] = none
            layouts[expert % gpus][m.name] = [Box.whole(m.shape)]
            continue
        dim = 1 if any(k in m.name for k in _ROW_PARALLEL) else 0
        for r, held in enumerate(layouts):
            held[m.name] = [chunk_box(m.shape, dim, r, gpus)]
    return [ShardLayout(b) for b in layouts]


class Shards:
    """Which regions each rank of a replica keeps (:func:`rollout_layouts`, or ``layouts``
    given, read through the engines' own :meth:`ShardLayout.wants`): made once per model
    and replica size, shared by every backend and bucket size :func:`plan` tries, with what
    they all read of the model (its bucket plans, its sharded pairs), worked out once."""

    def __init__(self, manifest: Manifest, gpus: int, layouts: Sequence[ShardLayout] | None = None):
        self.manifest, self.gpus = manifest, gpus
        if layouts is not None and len(layouts) != gpus:
            raise PlanError(f"{len(layouts)} layouts for a replica of {gpus} GPUs")
        layouts = rollout_layouts(manifest, gpus) if layouts is None else layouts
        self.wants = [lay.wants(manifest, r) for r, lay in enumerate(layouts)]
        metas = manifest.metas
        #: payload bytes each rank of a replica keeps
        self.bytes = [sum(b.numel * metas[i].itemsize for i, b in w) for w in self.wants]
        self._pairs: dict[tuple[int, int, float], tuple[Any, ...]] = {}
        self._bucket_plans: dict[tuple[int, int, int], tuple[Manifest, BucketPlan]] = {}

    def bucket_plan(self, sending: Manifest, bucket_size: int, senders: int) -> BucketPlan:
        """The engines' :class:`BucketPlan` of ``sending``, made once per bucket size and
        sender count (every whole-model schedule of a plan reads the same one)."""
        key = (id(sending), bucket_size, senders)
        got = self._bucket_plans.get(key)
        if got is None or got[0] is not sending:
            got = self._bucket_plans[key] = (sending, BucketPlan(sending, bucket_size, senders))
        return got[1]

    def pairs(self, sending: Manifest, senders: int, scale: float
              ) -> tuple[dict[tuple[int, int], float], list[int], list[int]]:
        """The bytes each (sender, rank of a replica) pair moves, the pieces each sender
        cuts per replica, and each tensor's sender (:meth:`ShardPlan._senders`): worked out
        once per sending manifest (every sharded schedule and bucket size reads them)."""
        key = (id(sending), senders, scale)
        got = self._pairs.get(key)
        if got is None or got[0] is not sending:
            metas = self.manifest.metas
            owner = ShardPlan._senders(sending, [m.nbytes for m in metas], senders)
            pair: dict[tuple[int, int], float] = defaultdict(float)
            pieces = [0] * senders
            for r, wanted in enumerate(self.wants):
                for i, b in wanted:
                    pair[(owner[i], r)] += b.numel * metas[i].itemsize * scale
                    pieces[owner[i]] += 1
            got = self._pairs[key] = (sending, dict(pair), pieces, owner)
        return got[1], got[2], got[3]


def _expert_index(name: str) -> int | None:
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def megatron_homes(manifest: Manifest, lay: Layout) -> Manifest:
    """``manifest`` with :attr:`Manifest.homes`: the senders (ranks of one Megatron
    data-parallel replica) that hold each tensor. A decoder layer's tensors live on its
    pipeline stage (layers split evenly, the embedding on the first, the final norm and the
    head on the last); an expert on its expert-parallel rank (experts split in contiguous
    blocks) and on every tensor-parallel rank there (expert TP 1); every other tensor on all
    of its stage's ranks (a tensor-parallel matrix in pieces: see :func:`tp_split`)."""
    metas = manifest.metas
    layers = 1 + max((_layer_index(m.name) for m in metas), default=0)
    experts = 1 + max((e for m in metas if (e := _expert_index(m.name)) is not None), default=0)
    homes = []
    for m in metas:
        name = m.name.removesuffix("_scale_inv")
        layer = _layer_index(name)
        if layer >= 0:
            stage = layer * lay.pp // layers
        else:
            stage = 0 if "embed" in name else lay.pp - 1
        e = _expert_index(name)
        eps = [e * lay.ep // experts] if e is not None else range(lay.ep)
        homes.append({lay.sender_of(stage, r, t) for r in eps for t in range(lay.tp)})
    return Manifest(metas, homes)


def tp_split(name: str, shape: Sequence[int]) -> bool:
    """Whether a Megatron trainer holds this tensor in tensor-parallel pieces (every matrix
    but the experts' and the router's; vectors are replicated)."""
    return len(shape) == 2 and _expert_index(name) is None and \
        not name.endswith(("mlp.gate.weight", "_scale_inv"))


def _layer_index(name: str) -> int:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return -1


# --- the links ------------------------------------------------------------------------------
class _Links:
    """Bytes on each link of one update (a fluid model: concurrent transfers add up)."""

    def __init__(self, c: Cluster, cal: Calibration):
        self.c, self.cal = c, cal
        self.load: dict[tuple, float] = defaultdict(float)

    def hop(self, src: int, dst: int, nbytes: float) -> None:
        c = self.c
        if c.node_of(src) == c.node_of(dst):
            self.load[("nvlink out", src)] += nbytes
            self.load[("nvlink in", dst)] += nbytes
        else:
            self.load[("nic out", *c.nic_of(src))] += nbytes
            self.load[("nic in", *c.nic_of(dst))] += nbytes

    def pcie(self, gpu: int, nbytes: float, way: str) -> None:
        """``nbytes`` between GPU ``gpu`` and its host (``way``: "out" to the host, "in")."""
        self.load[(f"pcie {way}", gpu)] += nbytes

    def rate(self, key: tuple) -> float:
        c, cal = self.c, self.cal
        if key[0].startswith("nvlink"):
            return c.nvlink_gbps * GB * cal.nvlink_eff
        if key[0].startswith("pcie"):
            return c.pcie_gbps * GB * cal.pcie_eff
        return c.nic_gbps * GB * cal.nic_eff

    def link_of(self, src: int, dst: int) -> tuple[float, float]:
        """(rate, latency) of one hop from GPU ``src`` to GPU ``dst``."""
        c = self.c
        if c.node_of(src) == c.node_of(dst):
            return self.rate(("nvlink",)), c.nvlink_latency_us * 1e-6
        return self.rate(("nic",)), c.latency_us * 1e-6

    def busiest(self) -> tuple[float, str]:
        top = self.top(1)
        return (top[0][2], top[0][0]) if top else (0.0, "none")

    def top(self, n: int | None = None) -> list[tuple[str, float, float]]:
        """The ``n`` busiest links (all of them: None): (name, GB, seconds at its rate)."""
        keys = sorted(self.load, key=lambda k: -self.load[k] / self.rate(k))[:n]
        return [(_link_name(k), self.load[k] / GB, self.load[k] / self.rate(k)) for k in keys]

    def most(self, kind: str) -> float:
        return max((v for k, v in self.load.items() if k[0].startswith(kind)), default=0.0) / GB


def _link_name(k: tuple) -> str:
    return f"{k[0]} of GPU {k[1]}" if len(k) == 2 else f"{k[0]} {k[2]} of node {k[1]}"


# --- one update, as each backend schedules it -------------------------------------------------
@dataclass
class _Update:
    """One simulated update: what every schedule reads (the cluster, the layout, the model
    as it travels, the calibration) and what it fills in (the links' loads, the parts of the
    time that do not overlap with them, the bytes per rank, the extra memory)."""

    c: Cluster
    lay: Layout
    manifest: Manifest
    sending: Manifest  # the manifest with Megatron homes, where the senders hold pieces
    shards: Shards
    cal: Calibration
    bucket_size: int
    scale: float  # the share of the dense bytes that moves (delta updates: below 1)
    read_x: float  # trainer bytes read per wire byte (fp32 into bf16 buckets: 2)
    small_x: float  # the multi-tensor copy's time, x the bulk copy's
    num_buffers: int
    topology_kind: str
    links: _Links
    relay: int | None = None  # sharded-relay's fan-out k (None: the least time of 1, 2, 4)
    parts: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)  # bytes each sender sends
    received: list[float] = field(default_factory=list)  # bytes each rollout GPU receives
    extra_gib: float = 0.0
    buckets: int = 0
    bound: str = ""  # what bounds a schedule that crosses no link
    host_s: float = 0.0  # the busiest sender's host work that runs beside its transfers

    @property
    def wire(self) -> int:
        return self.manifest.nbytes

    def small_share(self, below: int = 16 << 20) -> float:
        """The share of the bytes in tensors under ``below`` bytes."""
        return sum(m.nbytes for m in self.manifest.metas if m.nbytes < below) / max(1, self.wire)

    def copy_s(self, nbytes: float, read_x: float = 1.0, small: float = 0.0,
               small_x: float | None = None) -> float:
        """A cast-copy on one GPU of ``nbytes`` written (``read_x`` x as many read), a share
        ``small`` of them in tensors under 16 MiB (the multi-tensor copy's rate, or ``small_x``
        of the bulk copy's)."""
        t = nbytes * (1 + read_x) / (self.c.hbm_gbps * GB * self.cal.hbm_eff)
        return t * (1 - small) + t * small * (self.small_x if small_x is None else small_x)

    def pipeline(self, buckets: list[float]) -> None:
        """A bucket pipeline's ends, which overlap with nothing: the first bucket's pack and
        the last one's unpack (``buckets``: their bytes, in order)."""
        if buckets:
            self.parts["pack+unpack"] = self.copy_s(buckets[0], self.read_x) + self.copy_s(buckets[-1])


_SCHEDULES: dict[str, Callable[[_Update, str], None]] = {}


def _schedule(*names: str) -> Callable[[Callable[[_Update, str], None]], Callable[[_Update, str], None]]:
    """Register a backend's schedule (a new backend adds a function here, no branch elsewhere)."""
    def register(fn: Callable[[_Update, str], None]) -> Callable[[_Update, str], None]:
        for name in names:
            _SCHEDULES[name] = fn
        return fn
    return register


@_schedule("nccl", "nixl")
def _bucket_trees(u: _Update, backend: str) -> None:
    """Every bucket to every rollout GPU, packed by the sender :class:`BucketPlan` names:
    ``nccl`` as one broadcast ring per sender over every rollout GPU (node by node, NCCL's
    order), ``nixl`` along the trees :func:`topology.choose` / ``layout`` give (chains are
    trees of one child), each relay forwarding a bucket once it holds all of it."""
    c, lay, links, cal = u.c, u.lay, u.links, u.cal
    T, R = lay.n_senders, lay.rollouts
    plan = u.shards.bucket_plan(u.sending, u.bucket_size, T)
    if lay.megatron:  # a packer gathers the TP pieces it lacks from its stage's TP peers
        for b in plan.buckets:
            split = sum(ch.nbytes for ch in b.chunks if tp_split(u.manifest[ch.index].name,
                                                                u.manifest[ch.index].shape))
            _gather(links, lay, b.owner, split)
    u.buckets = len(plan)
    u.sent = [sum(b.wire_bytes for b in plan.owned_by(s)) * u.scale for s in range(T)]
    rgpu = [lay.rollout_gpu(r) for r in range(R)]
    if backend == "nccl":
        order = sorted(rgpu, key=lambda g: (c.node_of(g), g))
        for s in range(T):
            chain = [lay.sender_gpu(s), *order]
            for a, b in zip(chain, chain[1:], strict=False):
                links.hop(a, b, u.sent[s])
        # (NCCL pipelines a bucket in small chunks: the fill is a chunk and a latency a hop)
        chain = [lay.sender_gpu(0), *order]
        u.parts["fill"] = sum((4 << 20) / rate + lat for rate, lat in
                              (links.link_of(a, b) for a, b in zip(chain, chain[1:], strict=False)))
    else:
        senders_gbps = c.nic_gbps if c.nodes > 1 else c.nvlink_gbps
        fan = topology.choose(T, R, kind=u.topology_kind, sender_gbps=senders_gbps,
                              receiver_gbps=senders_gbps)
        depth = 1
        for s in range(T):
            heads, children = topology.layout(s, R, fan)
            for h in heads:
                links.hop(lay.sender_gpu(s), rgpu[h], u.sent[s])
            for p, cs in children.items():
                for ch in cs:
                    links.hop(rgpu[p], rgpu[ch], u.sent[s])
            depth = max(depth, _depth(heads, children))
        rate, lat = links.link_of(rgpu[0], rgpu[-1])
        u.parts["fill"] = (depth - 1) * (u.bucket_size * u.scale / rate + lat)
        u.notes.append(f"nixl {fan.kind}: {fan.sender} head(s), {fan.relay} child(ren) per relay, "
                       f"depth {depth}")
    u.pipeline([b.wire_bytes * u.scale for b in plan.buckets])
    u.parts["tensors"] = len(u.manifest) / T * cal.tensor_s
    u.received = [u.wire * u.scale] * R
    u.extra_gib = u.num_buffers * u.bucket_size / GiB


@_schedule("mooncake")
def _mooncake(u: _Update, backend: str) -> None:
    """Each replica's leader reads every bucket from the sender :class:`BucketPlan` names,
    out of the sender's registered host slots (staged over its PCIe), into its own host and
    over its PCIe onto its GPU; the leader then broadcasts it to its replica's other GPUs
    (a ring over NVLink inside a node). Each sender's link carries its share once per replica."""
    lay, links = u.lay, u.links
    T = lay.n_senders
    plan = u.shards.bucket_plan(u.sending, u.bucket_size, T)
    u.buckets = len(plan)
    u.sent = [sum(b.wire_bytes for b in plan.owned_by(s)) * u.scale for s in range(T)]
    for s in range(T):
        links.pcie(lay.sender_gpu(s), u.sent[s], "out")
    for rep in range(lay.replicas):
        ranks = [lay.rollout_gpu(rep * lay.rollout_gpus + i) for i in range(lay.rollout_gpus)]
        for s in range(T):
            links.hop(lay.sender_gpu(s), ranks[0], u.sent[s])
        links.pcie(ranks[0], u.wire * u.scale, "in")
        for a, b in zip(ranks, ranks[1:], strict=False):
            links.hop(a, b, u.wire * u.scale)
    rate, lat = links.link_of(lay.sender_gpu(0), lay.rollout_gpu(0))
    pcie = links.rate(("pcie",))
    u.parts["fill"] = u.bucket_size * u.scale * (2 / pcie + 1 / rate) + lat  # (a bucket's staging)
    u.pipeline([b.wire_bytes * u.scale for b in plan.buckets])
    u.parts["tensors"] = len(u.manifest) / T * u.cal.tensor_s
    u.received = [u.wire * u.scale] * lay.rollouts
    u.extra_gib = u.num_buffers * u.bucket_size / GiB
    u.notes.append(f"not calibrated (no GPU rows): host slots over PCIe at {u.cal.pcie_eff:.0%} of "
                   f"nominal, assumed")


@_schedule("sharded", "sharded-relay")
def _sharded(u: _Update, backend: str) -> None:
    """One sender per tensor (:meth:`ShardPlan._senders`); each rank of every replica gets
    its regions (:meth:`ShardLayout.wants`) straight from that sender; or, relayed
    (``sharded-relay``: the engines' ``relay=k``), each rank of the first replica does, and
    forwards every bucket as it lands to rank r of the next replicas, along a k-ary tree
    (the k of the least time: a chain loads each link with one shard, a wider tree adds a
    shard per child to a relay's link and takes fewer hops of fill)."""
    lay, links = u.lay, u.links
    T = lay.n_senders
    metas = u.manifest.metas
    pair, pieces, senders = u.shards.pairs(u.sending, T, u.scale)
    relay = backend == "sharded-relay" and lay.replicas > 1
    fed = 1 if relay else lay.replicas  # the replicas the senders send to
    # a sender cuts and packs every piece it sends, for every replica it feeds, while its buckets go
    u.host_s = max(pieces) * fed * u.cal.piece_s
    u.sent = [0.0] * T
    for rep in range(fed):
        for (s, r), nbytes in pair.items():
            links.hop(lay.sender_gpu(s), lay.rollout_gpu(rep * lay.rollout_gpus + r), nbytes)
            u.sent[s] += nbytes
    u.buckets = sum(math.ceil(v / u.bucket_size) for v in pair.values()) * fed
    if relay:
        _relay(u, pair)
    if lay.megatron:  # (each tensor gathered once, on its sender)
        split: dict[int, float] = defaultdict(float)
        for i, m in enumerate(metas):
            if tp_split(m.name, m.shape):
                split[senders[i]] += m.nbytes
        for sender, nbytes in split.items():
            _gather(links, lay, sender, nbytes)
    first = min(u.bucket_size, max(pair.values()))
    u.pipeline([first, first])
    u.received = [u.shards.bytes[r % lay.rollout_gpus] * u.scale for r in range(lay.rollouts)]
    u.extra_gib = u.num_buffers * u.bucket_size / GiB
    if any(m.name.endswith("_scale_inv") for m in metas):
        u.notes.append("fp8 scales go whole to every rank of a replica")


def _relay(u: _Update, pair: dict[tuple[int, int], float]) -> None:
    """The relay trees of a ``sharded-relay`` update: rank r of replica 0 roots a k-ary
    tree over rank r of every replica (:class:`ShardPlan`'s, k from 1, 2, 4: the least
    link time plus fill), each member forwarding its shard to its children."""
    lay, links = u.lay, u.links
    n, gpus = lay.replicas, lay.rollout_gpus
    shard = max(u.shards.bytes) * u.scale
    rate, lat = links.link_of(lay.rollout_gpu(0), lay.rollout_gpu(gpus * (n - 1)))
    first = min(u.bucket_size, max(pair.values()))
    senders = max((sum(v for (s, _), v in pair.items() if s == t) for t in range(lay.n_senders)), default=0.0)

    def depth(k: int) -> int:  # hops from a root to its deepest member
        d, last = 0, n - 1
        while last > 0:
            last, d = (last - 1) // k, d + 1
        return d

    def cost(k: int) -> float:
        return max(senders, min(k, n - 1) * shard) / rate + depth(k) * (first / rate + lat)

    k = u.relay or min((1, 2, 4), key=lambda k: (cost(k), k))
    for r in range(gpus):
        members = [lay.rollout_gpu(rep * gpus + r) for rep in range(n)]
        for j in range(1, n):
            links.hop(members[(j - 1) // k], members[j], u.shards.bytes[r] * u.scale)
    u.parts["relay fill"] = depth(k) * (first / rate + lat)
    u.notes.append(f"relay={k} ({'a chain' if k == 1 else f'a {k}-ary tree'} of the {n} replicas per "
                   f"rank, depth {depth(k)})")


@_schedule("shm")
def _shm(u: _Update, backend: str) -> None:
    """The newest version kept in the node's host memory (``keep`` of them): trainer rank 0
    writes it once over its PCIe link, every rollout GPU reads its shard over its own."""
    c, lay, cal = u.c, u.lay, u.cal
    nodes = {c.node_of(lay.rollout_gpu(r)) for r in range(lay.rollouts)}
    if nodes != {c.node_of(lay.sender_gpu(0))}:
        raise PlanError("shm keeps versions in one host's memory: the rollouts must sit on the node of "
                        "trainer rank 0 (its publisher); across nodes use disk on a shared file system "
                        "or a relay")
    keep = 2
    if keep * u.wire / GiB > c.host_mem_gib:
        raise PlanError(f"shm keeps {keep} versions of {u.wire / GiB:.0f} GiB in host memory; a node has "
                        f"{c.host_mem_gib:g} GiB")
    u.sent = [u.wire * u.scale] + [0.0] * (lay.n_senders - 1)
    u.received = [u.shards.bytes[r % lay.rollout_gpus] * u.scale for r in range(lay.rollouts)]
    u.links.pcie(lay.sender_gpu(0), u.sent[0], "out")
    for r, nbytes in enumerate(u.received):
        u.links.pcie(lay.rollout_gpu(r), nbytes, "in")
    # (publish, then read: the readers take a version once it is whole)
    u.parts["publish"] = u.sent[0] / u.links.rate(("pcie",))
    u.parts["tensors"] = len(u.manifest) * cal.tensor_s
    u.bound = "PCIe: trainer rank 0 publishes, then each GPU reads"
    u.notes.append(f"host memory: {keep * u.wire / GiB:.0f} of {c.host_mem_gib:g} GiB; not calibrated "
                   f"(PCIe at {cal.pcie_eff:.0%} of nominal, assumed)")


@_schedule("colocated", "colocated-ring")
def _colocated(u: _Update, backend: str) -> None:
    """Each rollout rank's bytes copied on its own GPU from its trainer's: ``colocated``
    straight into the rollout's tensors, ``colocated-ring`` packed into a slot and unpacked
    from it, with a handshake per bucket. FSDP trainers gather the shards they lack first:
    the direct path in 256 MiB groups (casts, then the gathers, then the small tensors'
    rows copied out of one flat buffer), the ring a gather per tensor."""
    c, lay, cal = u.c, u.lay, u.cal
    u.received = [u.shards.bytes[r % lay.rollout_gpus] * u.scale for r in range(lay.rollouts)]
    u.sent = [u.wire * u.scale / lay.n_senders] * lay.n_senders
    mine = max(u.received)
    small = u.small_share()
    u.parts["tensors"] = len(u.manifest) * cal.colocated_tensor_s
    u.parts["fixed"] = cal.colocated_fixed_s
    u.bound = "HBM copy"
    T = lay.trainers
    ring = backend == "colocated-ring"
    if T > 1:
        got = u.wire * u.scale * (T - 1) / T
        rate = (c.nvlink_gbps * cal.allgather_eff if c.nodes == 1 else c.nic_gbps * cal.nic_eff) * GB
        u.parts["cast"] = u.copy_s(mine / T, u.read_x)
        if ring:  # one gather per tensor into a new tensor
            u.parts["all-gather"] = gather_each_s(u.manifest, T, rate, cal)
        else:  # 256 MiB groups; tensors under 64 MiB gathered flat and copied out of the buffer
            u.parts["all-gather"] = got / rate + math.ceil(mine / (256 << 20)) * cal.group_s
            u.parts["scatter"] = u.copy_s(mine * u.small_share(64 << 20), 1.0, 1.0)
        u.bound = "the all-gather over NVLink" if c.nodes == 1 else "the all-gather over NICs"
        if lay.rollout_gpus > 1:
            u.notes.append(f"every GPU gathers whole tensors ({got / GB:.1f} GB) and keeps 1/"
                           f"{lay.rollout_gpus} of them: the gather, not the copy, bounds it")
        read_x = 1.0  # (what is copied on is the gathered wire-dtype tensor)
    else:
        read_x = u.read_x
    if not ring:
        # (gathered in place with several trainers; one trainer's same-dtype copy, or its
        # float32 -> bfloat16 cast, is one kernel; other casts torch's multi-tensor copy)
        kernel_x = {1.0: cal.direct_copy_x, 2.0: cal.direct_cast_x}.get(read_x)
        u.parts["copy"] = 0.0 if T > 1 else u.copy_s(mine, read_x, small, kernel_x)
        return
    u.buckets = math.ceil(mine / u.bucket_size)
    u.parts["copy"] = u.copy_s(mine, read_x, small) + u.copy_s(mine, 1.0, small)
    # each bucket's stream sync and handshake stalls the GPU; under FSDP it stalls every
    # rank's next gather too, so the ranks' stalls add up
    u.parts["buckets"] = u.buckets * cal.ring_bucket_s * T
    u.extra_gib = u.num_buffers * u.bucket_size / GiB


# --- the simulator --------------------------------------------------------------------------
def simulate(c: Cluster, lay: Layout, manifest: Manifest, backend: str, *, bucket_size: int = GiB,
             trainer_dtype: torch.dtype = torch.bfloat16, delta: float | None = None,
             verify_every: int = 1, fp8: bool = False, num_buffers: int = 2, topology_kind: str = "auto",
             cal: Calibration = CALIBRATION, shards: Shards | None = None,
             relay: int | None = None) -> Prediction:
    """One update of ``manifest`` (as it travels: :func:`manifest_of`) by ``backend`` on
    cluster ``c`` laid out as ``lay``. ``trainer_dtype``: what the trainer holds (fp32 is
    cast into the buckets); ``delta``: the fraction of the elements that changed since the
    last update (a delta update then carries each sender's records, sized by the delta
    engine's own encoding rule, :func:`weightbus.engines.delta.record_bytes`), with the
    receivers' whole-destination check every ``verify_every`` updates (0: never);
    ``fp8``: the manifest carries fp8 payloads the trainer quantizes first; ``relay``: for
    ``sharded-relay``, the trees' fan-out k (the engines' ``relay=k``; None: the k of the
    least time among 1, 2, 4)."""
    if backend not in _SCHEDULES:
        raise PlanError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend.startswith("colocated") and not lay.colocated:
        raise PlanError(f"{backend} needs the rollouts on the trainers' GPUs (Layout(colocated=True))")
    if lay.colocated and not backend.startswith("colocated"):
        raise PlanError(f"a colocated layout is synced by colocated or colocated-ring, not {backend}")
    if delta is not None and not 0 < delta <= 1:
        raise PlanError(f"delta must be a fraction of the elements in (0, 1], got {delta}")
    if delta is not None and backend not in _DELTA:
        raise PlanError(f"delta updates run on the bucket engines ({', '.join(_DELTA)}), not {backend}")
    if verify_every < 0:
        raise PlanError(f"verify_every must be >= 0 (0: never), got {verify_every}")
    if relay is not None and (isinstance(relay, bool) or not isinstance(relay, int) or relay < 1):
        raise PlanError(f"relay must be None (the planner's pick) or an int >= 1 (1: a chain), got {relay!r}")
    lay.check(c)
    if shards is None or shards.manifest is not manifest or shards.gpus != lay.rollout_gpus:
        shards = Shards(manifest, lay.rollout_gpus)
    u = _Update(c, lay, manifest, megatron_homes(manifest, lay) if lay.megatron and not lay.colocated
                else manifest, shards, cal, bucket_size,
                scale=delta_share(manifest, delta, lay.n_senders) if delta is not None else 1.0,
                read_x=trainer_dtype.itemsize / 2 if not fp8 else 2.0,
                small_x=cal.small_copy_x[0 if trainer_dtype.itemsize <= 2 else 1],
                num_buffers=num_buffers, topology_kind=topology_kind, links=_Links(c, cal), relay=relay)
    _SCHEDULES[backend](u, backend)
    parts = u.parts
    link_s, where = u.links.busiest()
    # (a bucket pipeline's packs share HBM and SMs with the transfer; NVLink feels it, a NIC not)
    parts["links"] = link_s = link_s * (cal.overlap_x if u.buckets and where.startswith("nvlink") else 1.0)
    if u.host_s > link_s:  # the sender's host cannot keep its links busy
        parts["links"], where = u.host_s, "the senders' host (packing the pieces)"
    parts.setdefault("fixed", cal.fixed_s)
    hbm = c.hbm_gbps * GB
    if fp8:  # the trainer quantizes its share first (bf16 read, e4m3 + scales written)
        parts["quantize"] = quantize_s(manifest, c, cal) / lay.n_senders
        payloads = sum(m.nbytes for m in manifest.metas if m.dtype.itemsize == 1)
        if backend == "colocated" and lay.trainers == 1 and trainer_dtype.itemsize == 2:
            # direct mode: the quantizer writes the rollout's payloads itself
            # (QuantizedSource.direct_writer): no fp8 copy of the model, and only the scales and the
            # tensors served as they are copied after it
            parts["copy"] = u.copy_s(manifest.nbytes - payloads)
        else:
            u.extra_gib += payloads / lay.n_senders / GiB
    if delta is not None:
        mine = manifest.nbytes / lay.n_senders
        # the trainer's diff against what it sent last (read both, write the snapshot), and
        # the receiver's patches; the whole-destination check reads every byte it holds,
        # before the update writes, while the trainers diff: what the diff does not hide
        parts["diff"] = mine * 3 / (hbm * cal.diff_eff)
        parts["apply"] = max(u.received) / u.scale / hbm * _apply_x(delta, cal)
        if verify_every:
            check = max(u.received) / u.scale / (hbm * cal.verify_eff)
            parts["verify"] = max(0.0, check - parts["diff"]) / verify_every
        u.extra_gib += mine / GiB  # (the snapshot of what was sent)
        u.notes.append("delta: the floor is the dense update's (a delta update moves less)")
        if backend.startswith("sharded"):  # (each rank's changes of its own regions, patched in place)
            u.notes.append("delta on sharded receive: the rollout ranks' destinations must be views "
                           "(fixed placements), not loaders that place each region themselves (vLLM's)")
    floor = floor_s(c, lay, shards.bytes, cal)
    return Prediction(backend, sum(parts.values()), floor, where if link_s else u.bound,
                      u.links.most("nic"), u.links.most("nvlink"), max(u.received) / GB, u.extra_gib,
                      u.buckets, bucket_size, parts, u.links.top(8), u.notes,
                      sent_gb=[b / GB for b in u.sent], received_gb=[b / GB for b in u.received],
                      link_gb={name: gb for name, gb, _ in u.links.top()})


def gather_each_s(manifest: Manifest, ranks: int, rate: float, cal: Calibration = CALIBRATION) -> float:
    """Every tensor of ``manifest`` all-gathered on its own among ``ranks`` FSDP ranks (each
    receiving the others' shards at ``rate`` bytes/s), each call taking at least
    :attr:`Calibration.gather_call_s`: a model of many small tensors pays per call."""
    return sum(max(m.nbytes * (ranks - 1) / ranks / rate, cal.gather_call_s) for m in manifest.metas)


#: the backends the simulator plays, and those that send delta updates
BACKENDS = tuple(_SCHEDULES)
_DELTA = ("nccl", "nixl", "mooncake", "sharded", "sharded-relay")


def _apply_x(changed: float, cal: Calibration) -> float:
    """The receiver's apply, in units of one bulk read of the dense bytes, at ``changed``:
    interpolated in the delta kernels' measured table (:attr:`Calibration.apply_x`)."""
    pts = cal.apply_x
    if changed <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if changed <= x1:
            return y0 + (y1 - y0) * (changed - x0) / (x1 - x0)
    return pts[-1][1]


def delta_share(manifest: Manifest, changed: float, senders: int) -> float:
    """The share of the dense bytes a delta update moves when ``changed`` of every tensor's
    elements changed: each sender's piece (its 1/``senders`` of every tensor, the delta
    engine's split) becomes one record per bucket-sized run, encoded the smallest way (the
    engine's own rule). bf16 at 2%: ~6% of the bytes (measured on CPU: 5.9%)."""
    from weightbus.engines.delta import record_bytes  # (the engine's rule, not a copy of it)
    total = 0
    for m in manifest.metas:
        e, n = m.itemsize, m.numel
        for piece in (n // senders + (r < n % senders) for r in range(min(senders, n))):
            total += record_bytes(piece, max(1, round(piece * changed)), e)
    return min(1.0, total / manifest.nbytes)


def quantize_s(manifest: Manifest, c: Cluster, cal: Calibration = CALIBRATION) -> float:
    """One GPU quantizing every fp8 payload of ``manifest`` (bf16 read, e4m3 and its scale
    written): the kernel at its measured share of HBM, plus the host's cost per tensor."""
    payloads = [m for m in manifest.metas if m.dtype.itemsize == 1]
    moved = sum(3 * m.nbytes for m in payloads) + \
        sum(m.nbytes for m in manifest.metas if m.name.endswith("_scale_inv"))
    return moved / (c.hbm_gbps * GB * cal.quant_eff) + len(payloads) * cal.quant_tensor_s


def _gather(links: _Links, lay: Layout, sender: int, nbytes: float) -> None:
    """Sender ``sender`` gathers the (tp-1)/tp of ``nbytes`` its TP peers hold."""
    if lay.tp == 1 or not nbytes:
        return
    first = sender - sender % lay.tp
    for peer in range(first, first + lay.tp):
        if peer != sender:
            links.hop(lay.sender_gpu(peer), lay.sender_gpu(sender), nbytes / lay.tp)


def _depth(heads: list[int], children: dict[int, list[int]]) -> int:
    depth, frontier = 0, list(heads)
    while frontier:
        depth += 1
        frontier = [ch for p in frontier for ch in children.get(p, [])]
    return depth


def floor_s(c: Cluster, lay: Layout, want: list[int], cal: Calibration = CALIBRATION) -> float:
    """The physical floor: the bytes the busiest rollout GPU must hold (its shard of the
    model), through its fastest way in (its NIC from trainers on other nodes, NVLink from
    its own node, HBM when colocated), at the measured rates."""
    worst = 0.0
    for r in range(lay.rollouts):
        g, nbytes = lay.rollout_gpu(r), want[r % lay.rollout_gpus]
        if lay.colocated:
            # its own trainer's share at HBM (read and written), the others' share over
            # NVLink (FSDP spreads every tensor over the trainers)
            elsewhere = nbytes * (lay.trainers - 1) / lay.trainers
            across = c.nvlink_gbps * cal.nvlink_eff if c.nodes == 1 or lay.trainers <= c.gpus_per_node \
                else c.nic_gbps * cal.nic_eff
            worst = max(worst, (nbytes - elsewhere) * 2 / (c.hbm_gbps * GB * cal.hbm_eff),
                        elsewhere / (across * GB))
            continue
        elif any(c.node_of(lay.sender_gpu(s)) == c.node_of(g) for s in range(lay.n_senders)):
            rate = c.nvlink_gbps * GB * cal.nvlink_eff
        else:
            rate = c.nic_gbps * GB * cal.nic_eff
        worst = max(worst, nbytes / rate)
    return worst


def plan(c: Cluster, lay: Layout, manifest: Manifest, *, bucket_sizes: Sequence[int] = (256 << 20, GiB),
         **kw) -> list[Prediction]:
    """Every backend that fits the layout, each at its best bucket size, fastest first."""
    names = ("colocated", "colocated-ring") if lay.colocated else ("nccl", "nixl", "mooncake", "sharded")
    if not lay.colocated and lay.replicas > 1:
        names = (*names, "sharded-relay")
    one_node = {c.node_of(lay.rollout_gpu(r)) for r in range(lay.rollouts)} == {c.node_of(lay.sender_gpu(0))}
    if one_node and not lay.colocated:
        names = (*names, "shm")
    if kw.get("delta") is not None:
        names = tuple(n for n in names if n in _DELTA)
        if not names:
            raise PlanError(f"delta updates run on the bucket engines ({', '.join(_DELTA)}), not on a "
                            f"colocated layout")
    shards = Shards(manifest, lay.rollout_gpus)
    best: list[Prediction] = []
    for name in names:
        runs = []
        for size in bucket_sizes:
            runs.append(simulate(c, lay, manifest, name, bucket_size=size, shards=shards, **kw))
        best.append(min(runs, key=lambda p: p.seconds))
    return sorted(best, key=lambda p: p.seconds)
