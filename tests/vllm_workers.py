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

    def sparse_step(self, step, frac=0.02):
        """A step that changes ``frac`` of every tensor's elements (as a small-learning-rate
        step changes bf16 weights), by enough to change what the model generates."""
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for p in self.model.parameters():
                mask = torch.rand(p.shape, generator=g) < frac
                p.add_(torch.randn(p.shape, generator=g) * 0.5 * mask)

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
                 trainer_rank=None, trainer_world=None, bucket_size=None, **info):
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
                                             transport=transport, timeout=60, bucket_size=bucket_size,
                                             **info)
        self.engine = None

    def connect(self, client=None):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        self.engine = WeightTransferTrainerFactory.trainer_init(self.info, client=client,
                                                                source=self.source())

    def source(self, change=None):
        """The weights vLLM loads (checkpoint names and layouts, a tied head once);
        ``change`` maps names to replacement tensors (None removes one)."""
        from weightbus.integrations.hf import HFCheckpointSource, checkpoint_state_dict
        if not change:
            return HFCheckpointSource(self.model)  # converted anew at every update
        sd = checkpoint_state_dict(self.model)
        for k, v in change.items():
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

    def save(self, path):
        self.model.save_pretrained(path)

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


# ------------------------------------------------------------------ model families

def family_config(family):
    """A tiny transformers config of each model family the field trains (head_dim 64,
    which vLLM's CPU attention supports; GQA everywhere)."""
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen3":  # dense, GQA 4:1, untied head
        return tf.Qwen3Config(**common | {"num_key_value_heads": 1}, intermediate_size=256, head_dim=64,
                              tie_word_embeddings=False)
    if family == "llama-tied":  # tied embeddings
        return tf.LlamaConfig(**common, intermediate_size=256, head_dim=64, tie_word_embeddings=True)
    if family == "qwen3-moe":  # 8 experts, top-2, every layer sparse
        return tf.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=64, head_dim=64,
                                 num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                 mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)
    if family == "mixtral":  # the other MoE layout: block_sparse_moe.experts.N.w1/w2/w3
        return tf.MixtralConfig(**common, intermediate_size=96, head_dim=64, num_local_experts=4,
                                num_experts_per_tok=2, tie_word_embeddings=False)
    raise ValueError(family)


def make_family_model(path, family):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(family_config(family)).to(torch.float32).save_pretrained(path)


def set_rebuild(worker, on):
    """Runs in a vLLM worker: switch the rebuild of the MoE experts' packing (tests only)."""
    from weightbus.integrations.vllm import processing
    processing.REBUILD_SKIPPED_HOOKS = on
