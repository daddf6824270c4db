"""Updates into ``vllm serve`` (OpenAI server, ``VLLM_SERVER_DEV_MODE=1`` for the pause and
weight routes) on the native ``weightbus`` backend, driven over HTTP. Skipped where vLLM
is not installed."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from test_vllm_native import PROMPTS, make_model  # noqa: E402
from vllm_workers import NativeTrainer  # noqa: E402

from weightbus import WeightSyncError  # noqa: E402
from weightbus.comm import free_port  # noqa: E402
from weightbus.integrations.vllm import HTTPRollout, RolloutClient, sync_weights  # noqa: E402
from weightbus.integrations.vllm.loader import KEPT  # noqa: E402

T = 60


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-qwen2-http"))
    make_model(path, tied=True)
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path_factory.mktemp("logs") / "serve.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--port", str(port),
         "--skip-tokenizer-init", "--enforce-eager", "--dtype", "float32", "--max-model-len", "128",
         "--max-num-seqs", "4", "--seed", "0", "--weight-transfer-config", '{"backend": "weightbus"}'],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"vllm serve exited; see {log.name}"
        assert time.monotonic() < deadline, f"vllm serve did not start; see {log.name}"
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            time.sleep(1)
    yield path, url
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    log.close()


def complete(url, path, prompt, n=8):
    body = json.dumps({"model": path, "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=T) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def test_http_server_updates(server):
    path, url = server
    rollout = HTTPRollout(url, timeout=T)
    client = RolloutClient([rollout])
    tr = NativeTrainer(0, 1, path, free_port(), 1)
    tr.connect(client)
    try:
        previous = [complete(url, path, p) for p in PROMPTS]
        for step in (1, 2):
            tr.train_step(step)
            sync_weights(tr.engine, client, step)  # /pause?mode=keep -> update -> /resume
            got = [complete(url, path, p) for p in PROMPTS]
            assert got == tr.greedy(PROMPTS, 8) and got != previous
            previous = got
            assert rollout.weight_version() == str(step)
        tr.train_step(3)
        tr.set_source({"model.layers.0.self_attn.q_proj.weight": torch.ones(3, 3)})
        with pytest.raises(WeightSyncError, match="q_proj") as err:
            sync_weights(tr.engine, client, 3)
        assert KEPT in str(err.value)
        assert [complete(url, path, p) for p in PROMPTS] == previous  # still serving version 2
        assert rollout.weight_version() == "2"
    finally:
        tr.shutdown()
