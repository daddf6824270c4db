"""Where a delta update's time goes across processes: with this folder on PYTHONPATH and
``WEIGHTBUS_TIMELINE=<dir>``, every Python process that imports weightbus (the bench's
ranks included) records when each step of a delta update started and ended on its host
clock (CLOCK_MONOTONIC: one clock for every process of a machine) and appends them to
``<dir>/<pid>.jsonl`` at the end of each update. ``benchmarks/timeline_report.py`` lines
the ranks up. The steps are wrapped, never changed: the engine's own waits are what show.
With ``WEIGHTBUS_TIMELINE_GPU=1`` too, each delta kernel's launch is timed on the GPU
("K.diff", "K.write", ...: see ``_kernels_timed``)."""

import os

if os.environ.get("WEIGHTBUS_TIMELINE"):
    import functools
    import json
    import time

    _out = os.environ["WEIGHTBUS_TIMELINE"]
    _events: list = []

    def _wrap(owner, name, label, flush=False):
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                _events.append((label, t0, time.perf_counter()))
                if flush:
                    _drain_launches()
                    os.makedirs(_out, exist_ok=True)
                    with open(os.path.join(_out, f"{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps(_events) + "\n")
                    _events.clear()
        setattr(owner, name, timed)

    _launches: list = []  # (label, host time of the launch, start event, end event)

    def _kernels_timed():
        """WEIGHTBUS_TIMELINE_GPU=1: each delta kernel's launch timed by CUDA events too; at the
        end of an update the device is synchronized (after the update, outside its time) and
        each launch becomes a "K.<kernel>" step, placed on the host clock at the first launch's
        host time plus its GPU offset from that launch (the GPU starts it no earlier)."""
        import torch

        from weightbus.engines.delta import gpu_triton

        class Timed:
            def __init__(self, jit, label):
                self.jit, self.label = jit, label

            def __getitem__(self, grid):
                launch = self.jit[grid]

                def run(*a, **k):
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t = time.perf_counter()
                    e0.record()
                    launch(*a, **k)
                    e1.record()
                    _launches.append((self.label, t, e0, e1))
                return run

        for name in ("diff", "write", "bitcount", "apply"):
            setattr(gpu_triton, name, Timed(getattr(gpu_triton, name), f"K.{name}"))
        from weightbus.engines.delta import gpu

        _wrap(gpu.Diff, "__init__", "H.launch")  # (a group's pass one launched, on the host)
        _wrap(gpu.Diff, "finish", "H.finish")  # (its wait, layout and pass two's launch)

    def _drain_launches():
        if not _launches:
            return
        import torch

        torch.cuda.synchronize()
        _, t0, first, _ = _launches[0]
        for label, _t, e0, e1 in _launches:
            a = t0 + first.elapsed_time(e0) / 1e3
            _events.append((label, a, a + e0.elapsed_time(e1) / 1e3))
        _launches.clear()

    try:
        from weightbus.engines import collective
        from weightbus.engines.delta import receiver, sender

        for mod, side in ((sender, "T"), (receiver, "R")):
            _wrap(mod, "_plan", f"{side}.plan")
            _wrap(mod, "_agree", f"{side}.agree")
        _wrap(sender._Rounds, "take", "T.diff")
        _wrap(sender._Rounds, "ahead", "T.ahead")
        _wrap(sender, "_fill", "T.fill")
        _wrap(receiver, "_apply", "R.apply")
        _wrap(receiver.WholeCheck, "before_writes", "R.check0")
        _wrap(receiver.WholeCheck, "finish", "R.check1")
        E = collective.CollectiveEngine
        for n in ("_send", "_acquire", "_flush_send", "_wait_recv", "_post_recv", "_flush_recv",
                  "_exchange_header"):
            _wrap(E, n, n.strip("_"))
        _wrap(E, "_finish_settled", "finish_settled", flush=True)
        if os.environ.get("WEIGHTBUS_TIMELINE_GPU"):
            _kernels_timed()
        from weightbus.engines import delta  # (the engines call the package's names)
        _wrap(delta, "send", "T.update", flush=True)
        _wrap(delta, "receive", "R.update", flush=True)
    except Exception as e:  # noqa: BLE001 - a timeline is never worth a failed run
        print(f"timeline: not recording ({e})", flush=True)
