"""weightbus inside SGLang's tensor-parallel workers.

SGLang runs a user function in every TP worker through its ``custom_weight_loader`` hook:
an engine built with ``custom_weight_loader=[HOOK]`` calls ``HOOK(model, named_tensors)``
on every TP rank when ``update_weights_from_tensor(named_tensors, load_format=HOOK)`` is
called. weightbus's driver (:class:`~.replica.SGLangReplica`) sends its commands that way,
in the name of one zero-element tensor (SGLang's payload unpickler accepts only torch and
builtins): ``connect`` a weightbus engine in this worker (its rank in the group is the
replica's first rank plus the TP rank), ``receive`` one update into the model, ``digest``
what it holds, ``close``.

An update is received with any weightbus engine and loaded through the model's own
``load_weights`` (checkpoint names: SGLang's loaders fuse ``q/k/v`` and ``gate/up``, stack
the experts and take this rank's TP slice). Before a byte loads, the update's manifest is
dry-run through that same ``load_weights`` on meta tensors: a tensor the model does not
know (SGLang's loaders skip or only log one), a shape its loader refuses, or a parameter
the update leaves out or half fills refuses the update on every rank, and SGLang keeps
serving its previous weights.

Sharded (the replica's ``sharded``, on by default for a replica of several TP workers over
a collective engine): the same dry run records, through SGLang's own loaders
(:mod:`weightbus.integrations.placement`), which region of each update tensor this rank's
parameters take; the rank receives only those regions, point to point, each written
straight into its parameter. A tensor whose loader does more than place bytes arrives whole
and loads through ``load_weights`` as before.

Nothing here raises into SGLang: an exception in a weight loader ends its scheduler, and
the process that drives it with it. Each command's outcome goes to the group's store,
where the driver reads it (:mod:`weightbus.integrations.outcomes`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weightbus import config
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.errors import WeightbusError, WeightSyncError
from weightbus.integrations import outcomes
from weightbus.integrations.dryrun import load_into, loader_of, meta_copy, some
from weightbus.integrations.placement import Placement, Recorder
from weightbus.packing.shards import Box, ShardLayout
from weightbus.plan import Manifest
from weightbus.runtime.local import Rendezvous, connect

#: what SGLang's ``custom_weight_loader`` must list (and ``load_format`` names)
HOOK = "weightbus.integrations.sglang.worker.hook"
#: the name of a command tensor starts with this; the rest is the command as JSON
PREFIX = "weightbus:"
#: ends the error of an update refused before a byte loaded
KEPT = "SGLang kept its previous weights"
_log = logging.getLogger("weightbus")


def command(call: str, **fields: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` that carry one command to :func:`hook` on every TP rank."""
    return [(PREFIX + json.dumps({"call": call, **fields}), torch.empty(0))]


def hook(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """SGLang's ``custom_weight_loader`` entry point: runs one weightbus command in this
    TP worker. Never raises (see the module docstring)."""
    try:
        names = [n for n, _ in named_tensors]
        cmds = [json.loads(n[len(PREFIX):]) for n in names if n.startswith(PREFIX)]
        if len(cmds) != 1:
            raise WeightbusError(f"expected one weightbus command, got names {names[:3]}")
        _WORKER.run(model, cmds[0])
    except Exception as e:  # noqa: BLE001 - never into SGLang's scheduler
        _log.error("weightbus: SGLang worker: %s", e)


def _tp_rank() -> int:
    """This worker's TP rank: its rank in SGLang's default process group (one group of the
    TP ranks of one replica; pipeline and data parallelism are refused by the driver)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


class SGLangWorker:
    """The weightbus side of one SGLang TP worker (one per process)."""

    def __init__(self) -> None:
        self.engine: CheckpointEngine | None = None
        self.store: Any = None
        self.prefix = "weightbus"
        self.rank = _tp_rank()
        self.partial = False
        #: (model, manifest) -> (why refused, the placement recorded where sharded)
        self._verdicts: dict[tuple[int, int], tuple[str | None, Placement | None]] = {}
        self.dests = _Regions(self)

    def where(self) -> str:
        return f"SGLang worker {self.rank}"

    def run(self, model: torch.nn.Module, cmd: dict[str, Any]) -> None:
        call = cmd.get("call")
        if call == "connect":
            self.connect(model, cmd)
        elif call == "receive":
            self.receive(model, int(cmd["version"]))
        elif call == "digest":
            self.digest(model, cmd)
        elif call == "close":
            self.close()
        else:
            raise WeightbusError(f"unknown weightbus command {call!r}")

    def connect(self, model: torch.nn.Module, cmd: dict[str, Any]) -> None:
        """Join the trainers' group as rollout rank ``rank_offset + TP rank``. A failure
        once the store is reached fails every rank of the group at once, naming this
        worker; it is also posted for the driver."""
        self.close()
        T, R = int(cmd["trainer_world_size"]), int(cmd["rollout_world_size"])
        self.rank = int(cmd["rank_offset"]) + _tp_rank()
        done: list[outcomes.Outcome] = []
        rdv = None
        with outcomes.recorded(self.rank, "connect", done):
            if not 0 <= self.rank < R:
                raise WeightbusError(f"{self.where()}: outside the {R} rollout ranks the trainer "
                                     f"expects (rank_offset {cmd['rank_offset']})")
            kwargs = dict(cmd.get("engine_kwargs") or {})
            rdv = Rendezvous(cmd["master_address"], int(cmd["master_port"]), T + self.rank, T + R,
                             timeout=config.timeout(kwargs.get("timeout")), prefix=cmd["prefix"])
            try:
                if cmd["transport"] in ("nccl", "hccl", "colocated") and "device" not in kwargs:
                    kwargs["device"] = str(_device(model))
                engine = CheckpointEngineRegistry.new(cmd["transport"], role="rollout", **kwargs)
            except Exception as e:  # noqa: BLE001
                rdv.fail(f"{self.where()}: {e}")  # (raises here too)
            self.partial = bool(cmd.get("partial", False))
            self.dests.on = bool(cmd.get("sharded")) and hasattr(engine, "set_shard_destinations")
            if self.dests.on:  # (before prepare: the group learns that it shards as it forms)
                engine.set_shard_destinations(self.dests)  # type: ignore[attr-defined]
            connect(engine, rdv, T, R)
            self.engine, self.store, self.prefix = engine, rdv.store, cmd["prefix"]
        if rdv is not None:
            outcomes.post(rdv.store, cmd["prefix"], "connect", 0, done[0])

    def receive(self, model: torch.nn.Module, version: int) -> None:
        """One update into ``model``; its outcome (this worker's own cause, and whether the
        model kept its previous weights) goes to the group's store."""
        done: list[outcomes.Outcome] = []
        loading = self.dests.loading = _Loading()
        device = _device(model)
        cuda = device.type == "cuda"
        if cuda:  # (what the update allocates beyond what this worker held: no second model copy)
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        with outcomes.recorded(self.rank, "update_weights", done, kept=lambda: not loading.touched):
            self._receive(model, version, loading)
        if self.store is not None:
            outcome = done[0]
            if outcome.ok and self.engine is not None and self.engine.last_stats is not None:
                stats = self.engine.last_stats.to_dict()
                if cuda:
                    stats["peak_added_bytes"] = torch.cuda.max_memory_allocated(device) - held
                outcome = dataclasses.replace(outcome, stats=stats)
            outcomes.post(self.store, self.prefix, "update", version, outcome)

    def _receive(self, model: torch.nn.Module, version: int, loading: _Loading) -> None:
        if self.engine is None:
            raise WeightbusError(f"{self.where()}: connect comes first")
        own: list[Exception] = []  # this worker's cause (the agreed error is the first rank's)

        def validate(manifest: Manifest) -> None:
            key = (id(model), manifest.fingerprint)
            if key not in self._verdicts:  # (the model's parameters do not change between updates)
                self._verdicts[key] = self._check(model, manifest)
                while len(self._verdicts) > 8:
                    self._verdicts.pop(next(iter(self._verdicts)))
            why, placement = self._verdicts[key]
            self.dests.placement = (manifest.fingerprint, placement) if placement is not None else None
            if why is not None:
                own.append(WeightbusError(f"{self.where()}: {why}"))
                raise own[-1]

        try:
            stream = self.engine.receive_weights_sync(validate=validate)
            try:
                with torch.no_grad():
                    model.load_weights(loading.count(stream))  # type: ignore[operator]
            finally:
                stream.close()  # type: ignore[attr-defined]
        except Exception as e:
            cause = own[0] if own else e
            if not loading.touched:
                raise WeightSyncError(str(cause) if KEPT in str(cause) else f"{cause} [{KEPT}]") from e
            raise WeightSyncError(str(cause)) from e
        if self.engine.version != version:
            raise WeightSyncError(f"{self.where()}: received version {self.engine.version}, "
                                  f"expected {version}")

    def _check(self, model: torch.nn.Module, manifest: Manifest) -> tuple[str | None, Placement | None]:
        """Why ``manifest`` would be refused, and where sharded, where its bytes land."""
        if not self.dests.on:
            return dry_run(model, manifest, self.partial), None
        recorder = Recorder()
        why = dry_run(model, manifest, self.partial, recorder)
        if why is not None:
            plain = dry_run(model, manifest, self.partial)
            if plain is None:  # (the tracked stand-ins failed, not the update: tensors come whole)
                _log.warning("weightbus: %s: recording where each tensor lands failed (%s); this "
                             "manifest's tensors arrive whole", self.where(), why)
            return plain, None
        placement = recorder.result(manifest, _placeable)
        _log.info("weightbus: %s: placement of manifest %#x: %s", self.where(), manifest.fingerprint,
                  placement.describe())
        return None, placement

    def digest(self, model: torch.nn.Module, cmd: dict[str, Any]) -> None:
        """Post a SHA-256 of every parameter this worker holds (SGLang's own names, this
        rank's slice), for checks against a reference load."""
        import hashlib
        done: list[outcomes.Outcome] = []
        out: dict[str, str] = {}
        with outcomes.recorded(self.rank, "digest", done):
            for name, p in model.named_parameters():
                raw = p.detach().contiguous().view(-1).view(torch.uint8).cpu()
                out[name] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        if self.store is not None:
            outcome = dataclasses.replace(done[0], stats={"digests": out}) if done[0].ok else done[0]
            outcomes.post(self.store, self.prefix, "digest", int(cmd["nonce"]), outcome)

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine, self.store = self.engine, None, None
            try:
                engine.finalize(destroy_group=True)
            except Exception as e:  # noqa: BLE001 - nothing left to do with it
                _log.warning("weightbus: %s: finalizing the engine: %s", self.where(), e)


class _Regions:
    """The engine's shard destinations in one TP worker: the layout recorded by the update's
    dry run, and each received region written where SGLang's loaders would write it."""

    def __init__(self, worker: SGLangWorker) -> None:
        self.worker = worker
        self.on = False
        self.placement: tuple[int, Placement] | None = None  # (manifest fingerprint, placement)
        self.loading: _Loading | None = None  # the update under way (a region touches the model)
        self._filled: set[int] = set()  # layers whose constants this update wrote

    def layout(self, manifest: Manifest) -> ShardLayout | None:
        self._filled = set()
        if self.placement is None or self.placement[0] != manifest.fingerprint:
            return None
        return self.placement[1].layout

    def place(self, name: str, box: Box, data: torch.Tensor) -> None:
        if self.placement is None:
            raise WeightbusError(f"{self.worker.where()}: region {box} of {name!r} arrived, but no "
                                 f"placement is recorded")
        placement = self.placement[1]
        if self.loading is not None:
            self.loading.touched = True
        with torch.no_grad():
            for sc in placement.scatters.get(name, ()):
                inner = sc.box.intersect(box)
                if inner is None:
                    continue
                if id(sc.layer) not in self._filled:  # (what the loader writes beside the bytes:
                    self._filled.add(id(sc.layer))  # a vocabulary's padding rows zeroed)
                    for fill in placement.fills.get(sc.layer, ()):
                        fill.apply(getattr(sc.layer, fill.param))
                param = getattr(sc.layer, sc.param)
                sc.view(param)[inner.within(sc.box)].copy_(data[inner.within(box)])


def _placeable(layer: torch.nn.Module, param: str) -> str | None:
    """Why a region recorded into ``param`` of ``layer`` cannot be written in place: a
    quantized layer's method processes its weights after they load."""
    method = getattr(layer, "quant_method", None)
    if method is not None and not type(method).__name__.startswith("Unquantized"):
        return f"{type(method).__name__} processes its weights after loading"
    return None


_WORKER = SGLangWorker()


class _Loading:
    """Whether any received tensor reached the model's loaders (after that, a failure
    may leave some parameters new: the model is torn)."""

    def __init__(self) -> None:
        self.touched = False

    def count(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in stream:
            self.touched = True
            yield item


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _skipped_on_purpose(model: torch.nn.Module, name: str) -> bool:
    """Checkpoint tensors SGLang's loaders skip by design: rotary caches, and the output
    projection of a model whose embedding is tied to it."""
    if "rotary_emb." in name:
        return True
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    return tied and name.startswith("lm_head.")


def _default_loader() -> Any:
    try:
        from sglang.srt.model_loader.weight_utils import default_weight_loader
        return default_weight_loader
    except ImportError:  # (CPU tests: the same contract, a shape-checked copy)
        def load(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
            if param.shape != loaded_weight.shape:
                raise ValueError(f"shape {list(loaded_weight.shape)} does not fit the parameter's "
                                 f"{list(param.shape)}")
            param.data.copy_(loaded_weight)
        return load


def dry_run(model: torch.nn.Module, manifest: Manifest, partial: bool = False,
            recorder: Recorder | None = None) -> str | None:
    """Run ``model.load_weights`` over meta tensors shaped like ``manifest``, every
    parameter's loader writing into a meta stand-in of it. Returns why the update would
    fail (a name no parameter takes, a shape a loader refuses, a parameter left out or
    half filled), or None. With a ``recorder``, the stand-ins are tracked: it records where
    each region lands (:mod:`weightbus.integrations.placement`)."""
    params: dict[int, tuple[str, torch.Tensor]] = {}
    owner: dict[int, tuple[torch.nn.Module, str, str]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod._parameters.items():
            if p is not None and id(p) not in params:
                params[id(p)] = (f"{mod_name}.{pname}" if mod_name else pname, p)
                owner[id(p)] = (mod, mod_name, pname)
    loaded = dict.fromkeys(params, 0)
    calls = [0]  # loader calls so far: a tensor that made none was taken by no parameter
    default = _default_loader()

    def stand_in(key: int, original: Any, meta: torch.Tensor) -> Any:
        def load(param: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            out, copied = load_into(meta, original, args, kwargs, recorder, owner[key])
            loaded[key] += copied
            return out
        return load

    patched = []
    for key, (_, p) in params.items():
        prev = loader_of(p)
        # (SGLang's BasevLLMParameter serves ``weight_loader`` from ``_weight_loader``)
        attr = "_weight_loader" if isinstance(getattr(type(p), "weight_loader", None), property) \
            else "weight_loader"
        had = attr in p.__dict__
        setattr(p, attr, stand_in(key, prev or default, meta_copy(p)))
        patched.append((p, attr, had, prev))
    current = ["(none yet)"]
    unknown: list[str] = []

    def metas() -> Iterator[tuple[str, torch.Tensor]]:
        for m in manifest:
            before = calls[0]
            current[0] = m.describe()
            yield m.name, (recorder.tracked(m.name, m.shape, m.dtype) if recorder is not None
                           else torch.empty(m.shape, dtype=m.dtype, device="meta"))
            if calls[0] == before and not _skipped_on_purpose(model, m.name):
                unknown.append(m.name)  # (read when the loader asks for the next one)

    try:
        try:
            with torch.no_grad():
                model.load_weights(metas())  # type: ignore[operator]
        except (NotImplementedError, RuntimeError) as e:
            if "meta" in str(e) and "size" not in str(e) and "shape" not in str(e):
                _log.warning("weightbus: cannot dry-run this model's loaders on meta tensors (%s); "
                             "the update is not checked before it loads", e)
                return None
            return f"SGLang's loader refuses tensor {current[0]}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - reported as the reason
            if isinstance(e, (KeyError, AttributeError, IndexError)):
                return (f"SGLang's {type(model).__name__} does not know tensor {current[0]}: its loader "
                        f"raised {type(e).__name__}: {e}")
            return f"SGLang's loader refuses tensor {current[0]}: {type(e).__name__}: {e}"
    finally:
        for p, attr, had, prev in patched:
            if had:
                setattr(p, attr, prev)
            else:
                delattr(p, attr)
    if unknown:
        return (f"SGLang's {type(model).__name__} takes no parameter from {len(unknown)} tensor(s) of the "
                f"update: {some(unknown)} (check the trainer's names: SGLang loads checkpoint names)")
    half = [f"{n} ({loaded[k]} of {p.numel()} elements)" for k, (n, p) in params.items()
            if 0 < loaded[k] < p.numel()]
    if half:
        return f"the update fills only part of {len(half)} parameter(s): {some(half)}"
    missing = [n for k, (n, p) in params.items() if not loaded[k] and p.numel()]
    if missing and not partial:
        return (f"the update leaves out {len(missing)} parameter(s) of the model: {some(missing)} "
                f"(partial=True allows partial updates)")
    return None
