"""Updates into a serving ``AsyncLLM`` (native ``weightbus`` backend) while requests are in
flight: ``keep`` freezes them and they finish on the new weights, ``abort`` ends them with
finish reason ``abort``; the engine never dies. Skipped where vLLM is not installed."""

import asyncio
import os
import threading
import time

import pytest

vllm = pytest.importorskip("vllm")

from test_vllm_native import PROMPTS, make_model  # noqa: E402
from vllm_workers import NativeTrainer  # noqa: E402

from weightbus.comm import free_port  # noqa: E402
from weightbus.integrations.vllm import AsyncLLMRollout, RolloutClient, sync_weights  # noqa: E402

T = 60
LONG = 120  # tokens of an in-flight request (the context is 128)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """An AsyncLLM on an event loop of its own thread, like a server's."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    path = str(tmp_path_factory.mktemp("tiny-qwen2-untied"))
    make_model(path, tied=False)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="vllm-loop").start()
    args = AsyncEngineArgs(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                           max_model_len=128, max_num_seqs=4, seed=0,
                           weight_transfer_config={"backend": "weightbus"})

    async def start():
        return AsyncLLM.from_engine_args(args)

    engine = asyncio.run_coroutine_threadsafe(start(), loop).result(180)
    yield path, engine, loop
    engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)


class Request:
    """One streaming greedy request on the engine's loop; ``tokens`` grows as it runs."""

    _ids = 0

    def __init__(self, engine, loop, prompt, n):
        from vllm.sampling_params import RequestOutputKind
        Request._ids += 1
        self.tokens, self.final = [], None
        sp = vllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False,
                                 output_kind=RequestOutputKind.CUMULATIVE)

        async def run():
            async for out in engine.generate({"prompt_token_ids": prompt}, sp, f"r{Request._ids}"):
                self.tokens = list(out.outputs[0].token_ids)
                self.final = out
            return self.final

        self.future = asyncio.run_coroutine_threadsafe(run(), loop)

    def wait_tokens(self, n):
        deadline = time.monotonic() + T
        while len(self.tokens) < n and not self.future.done():
            assert time.monotonic() < deadline, "the request makes no progress"
            time.sleep(0.002)

    def result(self):
        return self.future.result(T)


def generate(engine, loop, prompt, n):
    return list(Request(engine, loop, prompt, n).result().outputs[0].token_ids)


@pytest.fixture(scope="module")
def trainer(served, tmp_path_factory):
    path, engine, loop = served
    tr = NativeTrainer(0, 1, path, free_port(), 1)
    client = RolloutClient([AsyncLLMRollout(engine, loop, timeout=T)])
    tr.connect(client)
    yield tr, client
    tr.shutdown()


def test_keep_in_flight_requests_finish_on_new_weights(served, trainer):
    path, engine, loop = served
    tr, client = trainer
    prompt = PROMPTS[0]
    old = generate(engine, loop, prompt, LONG)
    req = Request(engine, loop, prompt, LONG)
    req.wait_tokens(2)
    client.pause("keep")  # the request is frozen mid-way ...
    time.sleep(0.1)
    frozen = len(req.tokens)
    assert 0 < frozen < LONG and not req.future.done(), "the request must be in flight"
    time.sleep(0.2)
    assert len(req.tokens) == frozen  # ... and stays frozen while paused
    client.resume()

    tr.train_step(1)
    sync_weights(tr.engine, client, 1, mode="keep")  # pause(keep) -> update -> resume
    out = req.result()
    assert not engine.errored
    assert out.outputs[0].finish_reason == "length"
    tokens = list(out.outputs[0].token_ids)
    assert len(tokens) == LONG
    # the tokens before the update are the old weights', the rest the new weights' given
    # that prefix (its KV cache was recomputed): find the split
    split = next((k for k in range(frozen, LONG + 1) if tokens[:k] == old[:k]
                  and tokens[k:] == generate(engine, loop, prompt + tokens[:k], LONG - k)), None)
    assert split is not None, "the kept request mixes weights inconsistently"
    assert engine_greedy(engine, loop) == tr.greedy(PROMPTS, 8)
    assert asyncio.run_coroutine_threadsafe(engine.get_weight_version(), loop).result(T) == "1"


def test_abort_ends_in_flight_requests(served, trainer):
    path, engine, loop = served
    tr, client = trainer
    req = Request(engine, loop, PROMPTS[1], LONG)
    req.wait_tokens(2)
    tr.train_step(2)
    sync_weights(tr.engine, client, 2, mode="abort")
    out = req.result()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) < LONG
    assert not engine.errored
    assert engine_greedy(engine, loop) == tr.greedy(PROMPTS, 8)  # serving the new weights


def engine_greedy(engine, loop, n=8):
    return [generate(engine, loop, p, n) for p in PROMPTS]
