"""Where a delta update's time goes across processes: with this folder on PYTHONPATH and
``WEIGHTBUS_TIMELINE=<dir>``, every Python process that imports weightbus (the bench's
ranks included) records when each step of a delta update started and ended on its host
clock (CLOCK_MONOTONIC: one clock for every process of a machine) and appends them to
``<dir>/<pid>.jsonl`` at the end of each update. ``benchmarks/timeline_report.py`` lines
the ranks up. The steps are wrapped, never changed: the engine's own waits are what show."""

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
                    os.makedirs(_out, exist_ok=True)
                    with open(os.path.join(_out, f"{os.getpid()}.jsonl"), "a") as f:
                        f.write(json.dumps(_events) + "\n")
                    _events.clear()
        setattr(owner, name, timed)

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
        from weightbus.engines import delta  # (the engines call the package's names)
        _wrap(delta, "send", "T.update", flush=True)
        _wrap(delta, "receive", "R.update", flush=True)
    except Exception as e:  # noqa: BLE001 - a timeline is never worth a failed run
        print(f"timeline: not recording ({e})", flush=True)
