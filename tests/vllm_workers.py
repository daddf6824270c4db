"""A transformers trainer for the real-vLLM tests (spawned; needs transformers)."""

import torch

from weightbus import ModuleSource
from weightbus.integrations.vllm.demo import greedy_tokens, lm_train_step
from weightbus.worker import WeightbusWorker


class HFTrainer(WeightbusWorker):
    def __init__(self, rank, world, path):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        self.extra = None

    def train_step(self, step):
        return lm_train_step(self.model, self.opt, seed=step, seq_len=24)

    def greedy(self, prompts, n):
        """What a transformers model holding these weights generates, greedily."""
        return greedy_tokens(self.model, prompts, n)

    def add_bogus(self, on):
        self.extra = {"model.bogus.weight": torch.ones(4, 4)} if on else None

    def weights_source(self):
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)  # tied to the embedding: vLLM has no separate copy
        if self.extra:
            sd.update(self.extra)
        return ModuleSource(sd)


class NativeTrainer:
    """One trainer rank of vLLM's own weight-transfer API with the ``weightbus`` backend:
    a transformers model taking real AdamW steps (ranks hold replicas, like DDP; each
    sends its own share of the buckets). Rank 0 runs in the test process next to vLLM."""

    def __init__(self, rank, world, path, port, rollout_world_size, transport="gloo", *,
                 trainer_rank=None, trainer_world=None, bucket_size=None):
        from transformers import AutoModelForCausalLM

        from weightbus.integrations.vllm.native import WeightbusTrainerInitInfo
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        rank = rank if trainer_rank is None else trainer_rank
        world = world if trainer_world is None else trainer_world
        self.info = WeightbusTrainerInitInfo(rank=rank, world_size=world, master_address="127.0.0.1",
                                             master_port=port, rollout_world_size=rollout_world_size,
                                             transport=transport, timeout=60, bucket_size=bucket_size)
        self.engine = None

    def connect(self, client=None):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        self.engine = WeightTransferTrainerFactory.trainer_init(self.info, client=client,
                                                                source=self.source())

    def source(self, change=None):
        """The state dict vLLM loads; ``change`` maps names to replacement tensors (None
        removes one)."""
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        for k, v in (change or {}).items():
            if v is None:
                sd.pop(k)
            else:
                sd[k] = v
        return ModuleSource(sd)

    def set_source(self, change=None):
        self.engine.source = self.source(change)

    def send(self, version):
        return self.engine.send_weights(version).bytes

    def train_step(self, step):
        return lm_train_step(self.model, self.opt, seed=step, seq_len=24)

    def greedy(self, prompts, n):
        return greedy_tokens(self.model, prompts, n)

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class BreakingSource:
    """A weight stream that raises after ``after`` tensors (a trainer failing mid-update)."""

    def __init__(self, source, after):
        self.source, self.after, self.manifest = source, after, source.manifest

    def __iter__(self):
        for i, item in enumerate(self.source):
            if i == self.after:
                raise RuntimeError("trainer failed mid-update")
            yield item


def vllm_param_digests(worker):
    """Runs in a vLLM worker (``llm.collective_rpc(vllm_param_digests)``): a bitwise digest
    of every parameter vLLM holds, under vLLM's names."""
    from weightbus.demo import digest
    return {n: digest(p) for n, p in worker.model_runner.model.named_parameters()}


def expected_vllm_digests(state_dict):
    """What vLLM's Qwen2 must hold for a transformers state dict: q/k/v and gate/up fused
    along dim 0; a tied lm_head is the embedding itself."""
    from weightbus.demo import digest
    sd, out = dict(state_dict), {}
    for name in list(sd):
        if ".self_attn.q_proj." in name:
            pre, kind = name.split(".self_attn.q_proj.")
            parts = [sd.pop(f"{pre}.self_attn.{p}_proj.{kind}") for p in "qkv"]
            out[f"{pre}.self_attn.qkv_proj.{kind}"] = digest(torch.cat(parts))
        elif ".mlp.gate_proj." in name:
            pre, kind = name.split(".mlp.gate_proj.")
            parts = [sd.pop(f"{pre}.mlp.{p}_proj.{kind}") for p in ("gate", "up")]
            out[f"{pre}.mlp.gate_up_proj.{kind}"] = digest(torch.cat(parts))
    for name, t in sd.items():
        out[name] = digest(t)
    return out
