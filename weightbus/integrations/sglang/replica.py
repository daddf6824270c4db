"""An SGLang engine (``sglang.Engine``, all its TP workers) as one replica of
:class:`weightbus.manager.CheckpointEngineManager`.

Each manager call maps onto SGLang's own API:

- the update runs in every TP worker through SGLang's ``custom_weight_loader`` hook
  (:mod:`.worker`), with any weightbus engine;
- generation pauses and continues through SGLang's tokenizer manager: ``abort``, ``keep``
  (SGLang's ``in_place``), ``wait`` (SGLang's weight-update lock waits for the requests
  in flight);
- the cache is flushed with the update (not under ``keep``: requests kept in place keep
  their cache), and the version is SGLang's own (``meta_info["weight_version"]``);
- hybrid (the manager's ``hybrid=True``, the engine built with
  ``enable_memory_saver=True``): ``sleep`` releases the engine's memory; the wake-up
  before an update takes back the weights and CUDA graphs only, the KV cache comes back
  after the update, so the weights and the KV cache are never both held beside the
  trainer. SGLang's memory saver keeps the parameters' virtual addresses across a
  release: CUDA graphs and the loaders' views stay valid.

Tested with sglang 0.5.12 (the version verl 0.9.1 pins).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightbus.errors import ConfigError, WeightbusError
from weightbus.integrations import outcomes
from weightbus.integrations.replicas import EngineReplica
from weightbus.integrations.sglang.worker import HOOK, command
from weightbus.runtime.group import Pending

#: the manager's pause modes, as SGLang's ``pause_generation`` names them (None: no pause;
#: SGLang's update waits for the requests in flight under its weight-update lock)
PAUSE_MODES = {"abort": "abort", "keep": "in_place", "wait": None}
#: what SGLang's memory saver releases (``sleep``)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def engine_args(**kwargs: Any) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments with weightbus's hook added to
    ``custom_weight_loader`` (what :class:`SGLangReplica` needs)."""
    given = kwargs.get("custom_weight_loader") or []
    if isinstance(given, str):  # (one dotted name, not its characters)
        given = [given]
    if not all(isinstance(x, str) for x in given):
        raise ConfigError(f"engine_args: custom_weight_loader must be a list of dotted function names, "
                          f"got {given!r}")
    loaders = list(given)
    if HOOK not in loaders:
        loaders.append(HOOK)
    return {**kwargs, "custom_weight_loader": loaders}


#: the backends whose engines receive sharded (``set_shard_destinations``)
SHARDED_TRANSPORTS = ("nccl", "gloo", "hccl")


class SGLangReplica(EngineReplica):
    """``engine``: an ``sglang.Engine`` built with :func:`engine_args` (its
    ``custom_weight_loader`` lists weightbus's hook). ``mode`` overrides the manager's pause
    mode for this replica. ``sharded``: each TP worker receives only the regions its
    parameters take (point to point, written in place) instead of every tensor whole;
    ``None`` shards where the replica has several TP workers and the manager's backend is a
    collective one (``nccl``, ``gloo``, ``hccl``). Calls into the engine run on the
    replica's own thread, one at a time: do not call the engine from another thread during
    an update."""

    def __init__(self, engine: Any, name: str = "sglang", *, mode: str | None = None,
                 sharded: bool | None = None):
        sa = getattr(engine, "server_args", None)
        if sa is None or not hasattr(sa, "tp_size"):
            raise ConfigError(f"SGLang replica {name!r}: expected an sglang.Engine (with server_args), "
                              f"got {type(engine).__name__}")
        if HOOK not in (sa.custom_weight_loader or []):
            raise ConfigError(f"SGLang replica {name!r}: the engine's custom_weight_loader does not list "
                              f"{HOOK!r}: build it with sglang.Engine(**engine_args(...))")
        if int(getattr(sa, "pp_size", 1)) != 1 or int(getattr(sa, "dp_size", 1)) != 1:
            raise ConfigError(f"SGLang replica {name!r}: pipeline or data parallelism inside one engine "
                              f"(pp_size {sa.pp_size}, dp_size {sa.dp_size}) is not supported: run one "
                              f"replica per data-parallel engine")
        if mode is not None and mode not in PAUSE_MODES:
            raise ConfigError(f"SGLang replica {name!r}: pause mode must be one of {list(PAUSE_MODES)}, "
                              f"got {mode!r}")
        if sharded not in (None, True, False):
            raise ConfigError(f"SGLang replica {name!r}: sharded must be True, False or None, "
                              f"got {sharded!r}")
        super().__init__(name, int(sa.tp_size))
        self.engine = engine
        self.mode = mode
        self.sharded = sharded
        self._paused = False
        self._mode_now = "abort"  # the pause the update runs under
        self._released: set[str] = set()
        self._nonce = 0  # digests: each read has its own keys in the store
        #: each worker's account of the last update (its engine's ``UpdateStats`` as a dict;
        #: on GPU ``peak_added_bytes``: what the update allocated beyond what the worker held)
        self.last_stats: list[dict[str, Any]] = []

    # --- the manager's calls ------------------------------------------------------------------
    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        if method == "wb_setup":
            return self._set_up(method, args)
        if method == "wb_connect":
            return self._submit(method, lambda: self._connect(*args[0]))  # type: ignore[index]
        if method == "wb_receive":
            return self._submit(method, lambda: self._receive(int(args[0][0])))  # type: ignore[index]
        if method == "wb_version":
            return self._submit(method, self.weight_version)
        if method == "wb_formats":  # (fp8 serving through this path is not supported yet)
            return self._submit(method, dict)
        if method == "pause_generation":
            mode = self.mode or (kwargs[0].get("mode") if kwargs else None) or "abort"
            return self._submit(method, lambda: self.pause(mode))
        if method == "resume_generation":
            return self._submit(method, self.resume)
        if method == "sleep":
            return self._submit(method, self.sleep)
        if method == "wake_up":
            return self._submit(method, self.wake_up)
        if method == "wb_teardown":
            return self._submit(method, lambda: self._command("close"))
        raise WeightbusError(f"{self.name}: an SGLang replica has no call {method!r}")

    # --- SGLang's own API ----------------------------------------------------------------------
    def _run(self, coro: Any) -> Any:
        return self.engine.loop.run_until_complete(coro)

    def _command(self, call: str, flush: bool = False, **fields: Any) -> None:
        """One weightbus command on every TP worker (see :mod:`.worker`); returns once
        every worker ran it. ``flush``: SGLang flushes its cache right after, under the same
        lock (it must be idle then: SGLang's scheduler asserts it)."""
        ok, message = self.engine.update_weights_from_tensor(command(call, **fields), load_format=HOOK,
                                                             flush_cache=flush)
        if not ok:
            raise WeightbusError(f"{self.name}: SGLang refused weightbus's {call!r} command: {message}")

    def weight_version(self) -> int | None:
        """The version SGLang serves (None: none, or an update left the model torn)."""
        v = str(self.engine.tokenizer_manager.server_args.weight_version)
        return int(v) if v.isdigit() else None

    def set_weight_version(self, version: str) -> None:
        self.engine.tokenizer_manager.server_args.weight_version = version

    def _shards(self) -> bool:
        """Whether this replica's TP workers receive sharded (see the class doc)."""
        if self.sharded is not None:
            return self.sharded
        return self.size > 1 and self._setup[0] in SHARDED_TRANSPORTS

    def pause(self, mode: str = "abort") -> None:
        """Stop generating before an update: ``abort`` the requests in flight, ``keep``
        them where they are (SGLang's ``in_place``), or ``wait`` for them (SGLang's
        update lock does)."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"{self.name}: pause mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self._mode_now = mode
        if PAUSE_MODES[mode] is None:
            return
        from sglang.srt.managers.io_struct import PauseGenerationReqInput
        self._run(self.engine.tokenizer_manager.pause_generation(PauseGenerationReqInput(mode=PAUSE_MODES[mode])))
        self._paused = True

    def resume(self) -> None:
        """Generate again; in a hybrid step, first take back the KV cache released at sleep."""
        if "kv_cache" in self._released:
            self._wake(["kv_cache"])
        if self._paused:
            from sglang.srt.managers.io_struct import ContinueGenerationReqInput
            self._run(self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput()))
            self._paused = False

    def sleep(self) -> None:
        """Release the engine's GPU memory (weights, KV cache, CUDA graphs); the engine must
        be idle (paused, or between generations)."""
        todo = [t for t in MEMORY_TAGS if t not in self._released]
        if todo:
            self.engine.release_memory_occupation(todo)
            self._released.update(todo)

    def wake_up(self) -> None:
        """Before an update: take back the weights and CUDA graphs (the KV cache comes back
        at :meth:`resume`, after the update)."""
        self._wake([t for t in ("cuda_graph", "weights") if t in self._released])

    def _wake(self, tags: list[str]) -> None:
        if tags:
            self.engine.resume_memory_occupation(tags)
            self._released.difference_update(tags)

    # --- an update -----------------------------------------------------------------------------
    def _connect(self, addr: str, port: int, prefix: str, rank: int, T: int, R: int) -> None:
        """Every TP worker joins the trainers' group (ranks ``rank`` on); a worker's failure
        is read from the store and raised here, naming it."""
        self._group = (addr, port, prefix, rank - T)
        failure: Exception | None = None
        try:
            self._command("connect", master_address=addr, master_port=port, prefix=prefix,
                          trainer_world_size=T, rollout_world_size=R, rank_offset=rank - T,
                          transport=self._setup[0], engine_kwargs=self._setup[1],
                          sharded=self._shards())
        except Exception as e:  # noqa: BLE001 - SGLang's own error, reported with the workers'
            failure = e
        ranks = range(rank - T, rank - T + self.size)
        got = outcomes.gather(self._store_at(addr, port), prefix, "connect", 0, ranks,
                              self._timeout() if failure is None else 1.0)
        why = outcomes.failure_of(got, f"{self.name}: joining the group", "SGLang")
        if why or failure:
            raise WeightbusError(why or f"{self.name}: joining the group failed: {failure}")

    def _receive(self, version: int) -> dict[str, Any]:
        """One update into every TP worker; every worker's outcome read from the group's
        store. On success the cache is flushed and the version set; a torn model's version
        is withdrawn ("none")."""
        addr, port, prefix, first = self._group
        store = self._store_at(addr, port)
        failure: Exception | None = None
        seen: list[outcomes.Outcome] = []
        try:  # (the cache of the old weights flushed at once, unless requests are kept in place)
            self._command("receive", flush=self._mode_now != "keep", version=version)
        except Exception as e:  # noqa: BLE001 - SGLang's own error (a dead scheduler, a deadline)
            failure = e
        why = outcomes.settle(store, prefix, version, range(first, first + self.size), self._timeout(),
                              failure, f"{self.name}: update to version {version}", self._finish,
                              lambda torn: self.set_weight_version("none"), seen, engine="SGLang")
        self.last_stats = [o.stats or {} for o in seen]
        if why is not None:
            raise WeightbusError(why)
        return {"bytes": 0}

    def digests(self) -> list[dict[str, str]]:
        """What each TP worker holds: a SHA-256 per parameter (SGLang's own names, each
        worker's slice), read after the group is formed; for checks against a reference
        load (e.g. ``engine.update_weights_from_disk`` of the trainer's checkpoint)."""
        addr, port, prefix, first = self._group
        if not addr:
            raise WeightbusError(f"{self.name}: digests are read through the group: form it first")
        self._nonce += 1
        nonce = self._nonce
        # (SGLang's call blocks until its scheduler answers: on the replica's pool, waited
        # for as long as any call of the manager's)
        self._submit("digest", lambda: self._command("digest", nonce=nonce)).result(self._timeout())
        got = outcomes.gather(self._store_at(addr, port), prefix, "digest", self._nonce,
                              range(first, first + self.size), self._timeout())
        why = outcomes.failure_of(got, f"{self.name}: reading digests", "SGLang")
        if why:
            raise WeightbusError(why)
        return [o.stats["digests"] for o in got]  # type: ignore[index]

    def _finish(self, version: str | None) -> None:
        if version is not None:
            self.set_weight_version(version)
