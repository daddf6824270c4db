"""What a weight sync would take on a cluster we do not have (``weightbus plan``).

The schedule is the engines' own: :class:`~weightbus.plan.BucketPlan` says which sender
packs which bucket (broadcast and chains), :meth:`ShardLayout.wants` and
:meth:`ShardPlan._senders` which regions each rollout rank takes and which sender sends
each tensor (sharded receive), :func:`weightbus.topology.choose` and ``layout`` the
trees ``nixl`` forwards along. What is simulated is how those bytes cross the links:

- every transfer is put on the links it crosses (an NVLink port out and in inside a node,
  a NIC out and in between nodes, rail-aligned; HBM on one GPU), and concurrent transfers
  share a link, so its load is the sum of what crosses it (a fluid model: contention is
  bytes adding up on the busiest link, which is what bounds a pipelined schedule);
- the update takes the busiest link's load at its rate (nominal x the efficiency measured
  on our machines), plus what does not overlap with it: the pipeline's fill (a relay
  forwards a bucket once it has it, so each hop of a chain adds a bucket), the first
  bucket's pack and the last one's unpack, a per-tensor host cost, per-bucket
  handshakes and a fixed per-update cost (the header and the agreed outcome);
- trainer-side work is added where it does not overlap: fp8 quantization, delta diffs.

:data:`CALIBRATION` holds every constant, each measured on our GPUs (benchmarks/RESULTS.md
names the rows; ``tests/test_simulate.py`` holds the simulator within 15% of them).
NIC figures are not measured here (our machines have none in use): ``nic_eff`` is an
assumption, and rows across nodes are predictions, not calibrated ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from weightbus import topology
from weightbus.cluster import Cluster, Layout
from weightbus.errors import PlanError
from weightbus.plan import BucketPlan, Manifest, TensorMeta
from weightbus.shards import Box, ShardLayout, ShardPlan, chunk_box

GB = 1e9
GiB = 1 << 30


@dataclass(frozen=True)
class Calibration:
    """Rates and costs measured on our machines (see the module doc)."""

    #: NCCL's broadcast over NVLink: 368 of 450 GB/s (2xH200, a raw broadcast of 16-65 GB)
    nvlink_eff: float = 0.817
    #: an all-gather over NVLink (FSDP2 gathering into the rollout's tensors): 252 of 450
    allgather_eff: float = 0.56
    #: assumed, not measured: a 400 Gb/s NIC's share NCCL and NIXL reach
    nic_eff: float = 0.90
    #: one bulk cast-copy on a GPU (H200: 14.8 ms for 62.4 GB read + written)
    hbm_eff: float = 0.88
    #: the multi-tensor copy of tensors under 16 MiB, x the bulk copy's time (bf16, fp32 src)
    small_copy_x: tuple[float, float] = (1.5, 1.25)
    #: the block-fp8 kernel (84% of an H200's HBM) and the host's cost per quantized tensor
    quant_eff: float = 0.84
    quant_tensor_s: float = 0.52e-6
    #: delta mode's diff on the trainer, x a bulk pass over the bytes it reads and writes
    diff_eff: float = 0.64
    #: per update (header, manifest, agreed outcome), per tensor (host walk), per bucket
    fixed_s: float = 3.3e-3
    tensor_s: float = 1.83e-6
    colocated_fixed_s: float = 5.0e-3
    ring_bucket_s: float = 0.58e-3  # the colocated ring's per-bucket stream sync + handshake
    group_s: float = 0.13e-3  # FSDP direct: a 256 MiB gather group's launch and wait
    #: assumed, not measured: the share of PCIe a host-memory cache's copies reach
    pcie_eff: float = 0.80
    #: colocated: per tensor, the bulk checks only (no per-tensor walk on either side)
    colocated_tensor_s: float = 0.055e-6


CALIBRATION = Calibration()

#: the backends the simulator plays
BACKENDS = ("nccl", "nixl", "sharded", "colocated", "colocated-ring", "shm")


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
    for m in manifest.metas:
        if gpus == 1 or len(m.shape) != 2 or m.name.endswith(("_scale_inv", "_scale")):
            continue
        expert = _expert_index(m.name)
        for r in range(gpus):
            if expert is not None:
                layouts[r][m.name] = [Box.whole(m.shape)] if expert % gpus == r else []
            else:
                dim = 1 if any(k in m.name for k in _ROW_PARALLEL) else 0
                layouts[r][m.name] = [chunk_box(m.shape, dim, r, gpus)]
    return [ShardLayout(b) for b in layouts]


class Shards:
    """Which regions each rank of a replica keeps (:func:`rollout_layouts`, read through the
    engines' own :meth:`ShardLayout.wants`): made once per model and replica size, shared by
    every backend and bucket size :func:`plan` tries."""

    def __init__(self, manifest: Manifest, gpus: int):
        self.manifest, self.gpus = manifest, gpus
        self.wants = [lay.wants(manifest, r) for r, lay in enumerate(rollout_layouts(manifest, gpus))]
        metas = manifest.metas
        #: payload bytes each rank of a replica keeps
        self.bytes = [sum(b.numel * metas[i].itemsize for i, b in w) for w in self.wants]


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

    def rate(self, key: tuple) -> float:
        c, cal = self.c, self.cal
        if key[0].startswith("nvlink"):
            return c.nvlink_gbps * GB * cal.nvlink_eff
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

    def top(self, n: int) -> list[tuple[str, float, float]]:
        """The ``n`` busiest links: (name, GB, seconds at its rate)."""
        keys = sorted(self.load, key=lambda k: -self.load[k] / self.rate(k))[:n]
        return [(f"{k[0]} of GPU {k[1]}" if len(k) == 2 else f"{k[0]} {k[2]} of node {k[1]}",
                 self.load[k] / GB, self.load[k] / self.rate(k)) for k in keys]

    def most(self, kind: str) -> float:
        return max((v for k, v in self.load.items() if k[0].startswith(kind)), default=0.0) / GB


# --- the simulator --------------------------------------------------------------------------
def simulate(c: Cluster, lay: Layout, manifest: Manifest, backend: str, *, bucket_size: int = GiB,
             trainer_dtype: torch.dtype = torch.bfloat16, delta: float | None = None,
             fp8: bool = False, num_buffers: int = 2, topology_kind: str = "auto",
             cal: Calibration = CALIBRATION, shards: Shards | None = None) -> Prediction:
    """One update of ``manifest`` (as it travels: :func:`manifest_of`) by ``backend`` on
    cluster ``c`` laid out as ``lay``. ``trainer_dtype``: what the trainer holds (fp32 is
    cast into the buckets); ``delta``: the fraction of the elements that changed since the
    last update (a delta update then carries each sender's records, sized by the delta
    engine's own encoding rule, :func:`weightbus.engines.delta.record_bytes`);
    ``fp8``: the manifest carries fp8 payloads the trainer quantizes first."""
    if backend not in BACKENDS:
        raise PlanError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend.startswith("colocated") and not lay.colocated:
        raise PlanError(f"{backend} needs the rollouts on the trainers' GPUs (Layout(colocated=True))")
    if lay.colocated and not backend.startswith("colocated"):
        raise PlanError(f"a colocated layout is synced by colocated or colocated-ring, not {backend}")
    if delta is not None and not 0 < delta <= 1:
        raise PlanError(f"delta must be a fraction of the elements in (0, 1], got {delta}")
    lay.check(c)
    T, R = lay.n_senders, lay.rollouts
    wire = manifest.nbytes
    scale = delta_share(manifest, delta, T) if delta is not None else 1.0
    links = _Links(c, cal)
    parts: dict[str, float] = {}
    notes: list[str] = []
    bound = ""  # (what bounds a schedule that crosses no link)
    if shards is None or shards.manifest is not manifest or shards.gpus != lay.rollout_gpus:
        shards = Shards(manifest, lay.rollout_gpus)
    want = shards.bytes
    small_x = cal.small_copy_x[0 if trainer_dtype.itemsize <= 2 else 1]

    def copy_s(nbytes: float, read_x: float = 1.0, small: float = 0.0) -> float:
        """A bulk cast-copy of ``nbytes`` written (``read_x`` x as many read), a share
        ``small`` of them in tensors under 16 MiB (the multi-tensor copy's rate)."""
        t = nbytes * (1 + read_x) / (c.hbm_gbps * GB * cal.hbm_eff)
        return t * (1 - small) + t * small * small_x

    small_share = sum(m.nbytes for m in manifest.metas if m.nbytes < 16 << 20) / max(1, wire)
    read_x = trainer_dtype.itemsize / 2 if not fp8 else 2.0  # (trainer bytes read per wire byte)
    buckets = 0

    sending = megatron_homes(manifest, lay) if lay.megatron and not lay.colocated else manifest
    if backend in ("nccl", "nixl"):
        plan = BucketPlan(sending, bucket_size, T)
        if lay.megatron:  # a packer gathers the TP pieces it lacks from its stage's TP peers
            for b in plan.buckets:
                split = sum(ch.nbytes for ch in b.chunks if tp_split(manifest[ch.index].name,
                                                                    manifest[ch.index].shape))
                _gather(links, lay, b.owner, split)
        buckets = len(plan)
        sent = [sum(b.wire_bytes for b in plan.owned_by(s)) * scale for s in range(T)]
        rgpu = [lay.rollout_gpu(r) for r in range(R)]
        if backend == "nccl":
            # one ring per sender over every rollout GPU, node by node (NCCL's order)
            order = sorted(rgpu, key=lambda g: (c.node_of(g), g))
            for s in range(T):
                chain = [lay.sender_gpu(s), *order]
                for a, b in zip(chain, chain[1:], strict=False):
                    links.hop(a, b, sent[s])
            # (NCCL pipelines a bucket in small chunks: the fill is a chunk and a latency a hop)
            chain = [lay.sender_gpu(0), *order]
            parts["fill"] = sum((4 << 20) / rate + lat for rate, lat in
                                (links.link_of(a, b) for a, b in zip(chain, chain[1:], strict=False)))
        else:
            senders_gbps = c.nic_gbps if c.nodes > 1 else c.nvlink_gbps
            fan = topology.choose(T, R, kind=topology_kind, sender_gbps=senders_gbps,
                                  receiver_gbps=senders_gbps)
            depth = 1
            for s in range(T):
                heads, children = topology.layout(s, R, fan)
                for h in heads:
                    links.hop(lay.sender_gpu(s), rgpu[h], sent[s])
                for p, cs in children.items():
                    for ch in cs:
                        links.hop(rgpu[p], rgpu[ch], sent[s])
                depth = max(depth, _depth(heads, children))
            # (a relay forwards a bucket once it has all of it)
            rate, lat = links.link_of(rgpu[0], rgpu[-1])
            parts["fill"] = (depth - 1) * (bucket_size * scale / rate + lat)
            notes.append(f"nixl {fan.kind}: {fan.sender} head(s), {fan.relay} child(ren) per relay, "
                         f"depth {depth}")
        parts["pack+unpack"] = 2 * copy_s(min(bucket_size, wire) * scale, read_x)
        parts["tensors"] = len(manifest) / T * cal.tensor_s
        received = [wire * scale] * R
        extra = num_buffers * bucket_size / GiB
    elif backend == "sharded":
        # one sender per tensor (ShardPlan's choice); each rank of every replica gets its
        # regions straight from that sender
        senders = ShardPlan._senders(sending, [m.nbytes for m in manifest.metas], T)
        pair: dict[tuple[int, int], float] = defaultdict(float)
        metas = manifest.metas
        for r, wanted in enumerate(shards.wants):
            for i, b in wanted:
                pair[(senders[i], r)] += b.numel * metas[i].itemsize * scale
        for rep in range(lay.replicas):
            for (s, r), nbytes in pair.items():
                links.hop(lay.sender_gpu(s), lay.rollout_gpu(rep * lay.rollout_gpus + r), nbytes)
        buckets = sum(math.ceil(v / bucket_size) for v in pair.values()) * lay.replicas
        if lay.megatron:  # (each tensor gathered once, on its sender)
            split: dict[int, float] = defaultdict(float)
            for i, m in enumerate(manifest.metas):
                if tp_split(m.name, m.shape):
                    split[senders[i]] += m.nbytes
            for sender, nbytes in split.items():
                _gather(links, lay, sender, nbytes)
        parts["pack+unpack"] = 2 * copy_s(min(bucket_size, max(pair.values())), read_x)
        parts["tensors"] = len(manifest) / T * cal.tensor_s * 2  # (a tensor's boxes per rank)
        received = [want[r % lay.rollout_gpus] * scale for r in range(R)]
        extra = num_buffers * bucket_size / GiB
        if any(m.name.endswith("_scale_inv") for m in manifest.metas):
            notes.append("fp8 scales go whole to every rank of a replica")
    elif backend == "shm":
        # the newest version kept in each node's host memory (`keep` of them): trainer rank 0
        # writes it once over its PCIe link, every rollout GPU reads its shard over its own
        nodes = {c.node_of(lay.rollout_gpu(r)) for r in range(R)}
        if nodes != {c.node_of(lay.sender_gpu(0))}:
            raise PlanError("shm keeps versions in one host's memory: the rollouts must sit on the node of "
                            "trainer rank 0 (its publisher); across nodes use disk on a shared file system "
                            "or a relay")
        keep = 2
        if keep * wire / GiB > c.host_mem_gib:
            raise PlanError(f"shm keeps {keep} versions of {wire / GiB:.0f} GiB in host memory; a node has "
                            f"{c.host_mem_gib:g} GiB")
        pcie = c.pcie_gbps * GB * cal.pcie_eff
        parts["publish"] = wire * scale / pcie
        received = [want[r % lay.rollout_gpus] * scale for r in range(R)]
        parts["read"] = max(received) / pcie  # (each GPU over its own link, at once)
        parts["tensors"] = len(manifest) * cal.tensor_s
        buckets, extra = 0, 0.0
        bound = "PCIe: trainer rank 0 publishes, then each GPU reads"
        notes.append(f"host memory: {keep * wire / GiB:.0f} of {c.host_mem_gib:g} GiB; not calibrated "
                     f"(PCIe at {cal.pcie_eff:.0%} of nominal, assumed)")
    else:  # colocated: each rollout rank's bytes copied on its own GPU from its trainer's
        received = [want[r % lay.rollout_gpus] * scale for r in range(R)]
        mine = max(received)
        parts["tensors"] = len(manifest) * cal.colocated_tensor_s
        parts["fixed"] = cal.colocated_fixed_s
        bound = "HBM copy"
        if lay.trainers > 1:  # FSDP: each GPU gathers the shards it lacks of whole tensors
            got = wire * scale * (lay.trainers - 1) / lay.trainers
            rate = c.nvlink_gbps * cal.allgather_eff if c.nodes == 1 else c.nic_gbps * cal.nic_eff
            parts["all-gather"] = got / (rate * GB) + math.ceil(mine / (256 << 20)) * cal.group_s
            parts["cast"] = copy_s(mine / lay.trainers, read_x)
            direct = 0.0  # (gathered straight into the rollout's tensors)
            bound = "the all-gather over NVLink" if c.nodes == 1 else "the all-gather over NICs"
            if lay.rollout_gpus > 1:
                notes.append(f"every GPU gathers whole tensors ({got / GB:.1f} GB) and keeps 1/"
                             f"{lay.rollout_gpus} of them: the gather, not the copy, bounds it")
        else:
            direct = copy_s(mine, read_x, small_share)
        if backend == "colocated":  # direct: written straight into the rollout's tensors
            parts["copy"] = direct
            extra = 0.0
        else:  # the ring: packed into a slot, unpacked from it, a handshake per bucket
            buckets = math.ceil(mine / bucket_size)
            parts["copy"] = copy_s(mine, read_x, small_share) + copy_s(mine, 1.0, small_share)
            parts["buckets"] = buckets * cal.ring_bucket_s
            extra = num_buffers * bucket_size / GiB
    link_s, where = links.busiest()
    parts["links"] = link_s
    parts.setdefault("fixed", cal.fixed_s)
    if fp8:  # the trainer quantizes its share first (bf16 read, e4m3 + scales written)
        parts["quantize"] = quantize_s(manifest, c, cal) / T
        extra += sum(m.nbytes for m in manifest.metas if m.dtype.itemsize == 1) / T / GiB  # (kept)
    if delta is not None:  # the diff against the last sent: read both, write the snapshot
        mine = manifest.nbytes / T
        parts["diff"] = mine * 3 / (c.hbm_gbps * GB * cal.diff_eff)
        extra += mine / GiB  # (the snapshot of what was sent)
    seconds = sum(parts.values())
    floor = floor_s(c, lay, want, cal)
    return Prediction(backend, seconds, floor, where if link_s else bound, links.most("nic"),
                      links.most("nvlink"), max(received) / GB, extra, buckets, bucket_size, parts,
                      links.top(8), notes)


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
    names = ("colocated", "colocated-ring") if lay.colocated else ("nccl", "nixl", "sharded")
    one_node = {c.node_of(lay.rollout_gpu(r)) for r in range(lay.rollouts)} == {c.node_of(lay.sender_gpu(0))}
    if one_node and not lay.colocated:
        names = (*names, "shm")
    shards = Shards(manifest, lay.rollout_gpus)
    best: list[Prediction] = []
    for name in names:
        runs = []
        for size in bucket_sizes:
            runs.append(simulate(c, lay, manifest, name, bucket_size=size, shards=shards, **kw))
        best.append(min(runs, key=lambda p: p.seconds))
    return sorted(best, key=lambda p: p.seconds)
