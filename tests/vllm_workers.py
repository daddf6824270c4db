"""A transformers trainer for the real-vLLM tests (spawned; needs transformers)."""

import torch

from weightbus import ModuleSource
from weightbus.integrations.vllm.demo import FSDPTrainer, greedy_tokens, lm_train_step
from weightbus.worker import WeightbusWorker


class HFTrainer(WeightbusWorker):
    #: send checkpoint names and layouts (HFCheckpointSource's), not the in-memory ones
    checkpoint_names = False

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
        if self.checkpoint_names:  # as save_pretrained writes them (MoE experts one by one)
            from weightbus.integrations.hf import checkpoint_state_dict
            sd = checkpoint_state_dict(self.model)
            sd.update(self.extra or {})
            return ModuleSource(sd)
        sd = dict(self.model.state_dict())
        if self.model.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)  # tied to the embedding: vLLM has no separate copy
        if self.extra:
            sd.update(self.extra)
        return ModuleSource(sd)


class HFCheckpointTrainer(HFTrainer):
    checkpoint_names = True


class NativeTrainer:
    """One trainer rank of vLLM's own weight-transfer API with the ``weightbus`` backend:
    a transformers model taking real AdamW steps (ranks hold replicas, like DDP; each
    sends its own share of the buckets). Rank 0 runs in the test process next to vLLM."""

    def __init__(self, rank, world, path, port, rollout_world_size, transport="gloo", *,
                 trainer_rank=None, trainer_world=None, bucket_size=None, timeout=60, **info):
        from transformers import AutoModelForCausalLM

        from weightbus.integrations.vllm import WeightbusTrainerInitInfo
        torch.set_num_threads(1)
        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-2)
        rank = rank if trainer_rank is None else trainer_rank
        world = world if trainer_world is None else trainer_world
        self.info = WeightbusTrainerInitInfo(rank=rank, world_size=world, master_address="127.0.0.1",
                                             master_port=port, rollout_world_size=rollout_world_size,
                                             transport=transport, timeout=timeout, bucket_size=bucket_size,
                                             **info)
        self.engine = None

    def connect(self, client=None):
        from weightbus.integrations.vllm import trainer_init
        self.engine = trainer_init(self.info, client=client, source=self.source())

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

    def break_source(self, after, kill=False):
        """The next update's stream fails after ``after`` tensors; ``kill``: this process
        dies there."""
        self.engine.source = BreakingSource(self.engine.source, after, kill=kill)

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
    """A weight stream that fails after ``after`` tensors: raises ``error`` (a trainer
    failing mid-update; a ``KeyboardInterrupt``: one interrupted), or with ``kill`` the
    trainer process dies there (SIGKILL)."""

    def __init__(self, source, after, error=None, kill=False):
        self.source, self.after, self.manifest = source, after, source.manifest
        self.error, self.kill = error or RuntimeError("trainer failed mid-update"), kill

    def __iter__(self):
        for i, item in enumerate(self.source):
            if i == self.after:
                if self.kill:
                    import os
                    import signal
                    os.kill(os.getpid(), signal.SIGKILL)
                raise self.error
            yield item


def vllm_param_digests(worker):
    """Runs in a vLLM worker (``llm.collective_rpc(vllm_param_digests)``): a bitwise digest
    of every parameter vLLM holds, under vLLM's names."""
    from weightbus.tools.demo import digest
    return {n: digest(p) for n, p in worker.model_runner.model.named_parameters()}


def expected_vllm_digests(state_dict):
    """What vLLM's Qwen2 must hold for a transformers state dict: q/k/v and gate/up fused
    along dim 0; a tied lm_head is the embedding itself."""
    from weightbus.tools.demo import digest
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
    if family == "qwen3-moe":  # 8 experts, top-2; the first layer's MLP dense (mlp_only_layers),
        # so one model holds every layer kind: fused qkv, dense gate_up/down, experts
        return tf.Qwen3MoeConfig(**common, intermediate_size=256, moe_intermediate_size=64, head_dim=64,
                                 num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
                                 mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False)
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


# ------------------------------------------------------------------ faults inside a vLLM worker

def inject_fault(worker, rank, kind, arg):
    """Runs in a vLLM worker (``llm.collective_rpc(inject_fault, args=(rank, kind, arg))``):
    on worker ``rank`` only, the next real load (not the preflight's dry run on meta
    tensors) fails: ``raise`` after ``arg`` tensors reached vLLM (its ``load_weights``,
    or, in a sharded update, regions written in place), or ``slow`` sleeps ``arg`` seconds
    before its first tensor. One shot."""
    import time

    from weightbus.integrations.vllm.loader import VLLMModelLoader
    if worker.rank != rank:
        return
    model = worker.model_runner.model
    original = model.load_weights
    place = VLLMModelLoader.__dict__.get("_unfaulted_place", VLLMModelLoader.place)
    VLLMModelLoader._unfaulted_place = place
    landed = [0]

    def disarm():
        model.__dict__.pop("load_weights", None)
        VLLMModelLoader.place = place

    def arrive():
        if kind == "slow" and landed[0] == 0:
            time.sleep(arg)
            disarm()
        landed[0] += 1
        if kind == "raise" and landed[0] > arg:
            disarm()
            raise RuntimeError(f"injected loader failure after {arg} tensors")

    def load_weights(weights):
        weights = iter(weights)
        first = next(weights, None)
        if first is None or first[1].is_meta:  # the preflight's dry run: untouched
            return original(([first] if first else []) + list(weights))

        def faulty():
            for item in [first, *weights]:
                arrive()
                yield item
        return original(faulty())

    def placing(self, name, box, data):
        arrive()
        return place(self, name, box, data)

    model.load_weights = load_weights
    VLLMModelLoader.place = placing


def clear_faults(worker):
    """Runs in a vLLM worker: remove a fault :func:`inject_fault` left unfired."""
    from weightbus.integrations.vllm.loader import VLLMModelLoader
    worker.model_runner.model.__dict__.pop("load_weights", None)
    saved = VLLMModelLoader.__dict__.get("_unfaulted_place")
    if saved is not None:
        VLLMModelLoader.place = saved


# ------------------------------------------------------------------ trainer ranks around one vLLM

class Trainers:
    """Native trainer ranks: rank 0 here (next to vLLM, which it drives), the others in a
    process of their own; every call goes to every rank."""

    def __init__(self, path, port, rollout, world=2, transport="gloo", bucket_size=None, timeout=60, **info):
        from weightbus.integrations.vllm import RolloutClient
        from weightbus.runtime.group import LocalWorkerGroup
        self.timeout = timeout
        self.rank0 = NativeTrainer(0, world, path, port, rollout.size, transport, bucket_size=bucket_size,
                                   timeout=timeout, **info)
        self.others = LocalWorkerGroup(NativeTrainer, world - 1, path, port, rollout.size, transport,
                                       trainer_rank=1, trainer_world=world, bucket_size=bucket_size,
                                       timeout=timeout, name="trainer1", **info) if world > 1 else None
        self.client = RolloutClient([rollout], timeout=max(60, 3 * timeout))
        self.each("connect", local_args=(self.client,))

    def each(self, method, *args, local_args=None):
        pending = self.others.submit(method, [args] * self.others.size) if self.others else None
        try:
            out = getattr(self.rank0, method)(*(local_args if local_args is not None else args))
        finally:
            if pending is not None:
                rest = pending.result(3 * self.timeout)
        return [out, *rest] if pending is not None else [out]

    def update(self, version, mode="keep"):
        """Every rank sends; a failure must reach every rank (rank 0's error names every
        vLLM worker that failed; the others' the first failing rank's cause)."""
        from weightbus import WeightSyncError
        from weightbus.integrations.vllm import sync_weights
        from weightbus.runtime.group import WorkerError
        pending = self.others.submit("send", [(version,)] * self.others.size) if self.others else None
        failure = None
        try:
            sync_weights(self.rank0.engine, self.client, version, mode=mode)
        except WeightSyncError as e:
            failure = e
        if pending is not None:
            try:
                pending.result(3 * self.timeout)
            except WorkerError:
                if failure is None:
                    raise
            else:
                assert failure is None, "rank 1 succeeded where rank 0 failed"
        if failure is not None:
            raise failure

    def close(self):
        try:
            self.each("shutdown")
        finally:
            if self.others:
                self.others.shutdown()


# ------------------------------------------------------------------ sharded receive

def received(worker):
    """Runs in a vLLM worker: (payload bytes, fallbacks) its engine counted for the last
    update (a sharded update: this worker's regions, and the tensors it took whole)."""
    stats = worker.weight_transfer_engine._engine.last_stats
    return stats.bytes, stats.fallbacks


def swap_loader(worker, rank, module, kind):
    """Runs in a vLLM worker: on worker ``rank``, ``module``'s weight gets another loader
    from the next update on (set where vLLM's reload restores loaders from): ``copy``
    computes on the bytes it gets (a copy of them) before the usual loader, ``refuse``
    raises; ``None`` puts the usual one back."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    if worker.rank != rank:
        return
    layer = dict(worker.model_runner.model.named_modules())[module]
    meta = get_layerwise_info(layer).restore_metadata[0]["weight"]
    usual = meta.__dict__.setdefault("_usual_loader", _get_original_loader(meta))
    if kind is None:
        meta.weight_loader = usual
        return

    def loader(param, loaded_weight, *args, **kwargs):
        if kind == "refuse":
            raise ValueError("this loader takes no more updates")
        bound = usual.__func__.__get__(layer) if hasattr(usual, "__func__") else usual
        return bound(param, loaded_weight.clone(), *args, **kwargs)

    meta.weight_loader = loader


class FSDPFamilyTrainer(FSDPTrainer):
    """One trainer rank: a family model (``make_family_model``) under FSDP2 over its own
    gloo world, sending checkpoint names and layouts (a MoE's experts one by one)."""

    def weights_source(self):
        from weightbus.integrations.hf import HFCheckpointSource
        return HFCheckpointSource(self.model)

    def shard_bytes(self, tp):
        """What one rank of a TP=``tp`` vLLM keeps of the update, by the rules of tensor
        parallelism (not by weightbus's plan): norms and the MoE router replicated, k/v
        replicated when the model has fewer KV heads than ranks, everything else split."""
        cfg = self.model.config
        total = kept = 0
        for m in self.weights_source().manifest.metas:
            total += m.nbytes
            whole = "norm" in m.name or m.name.endswith("mlp.gate.weight") or (
                cfg.num_key_value_heads < tp and any(f"self_attn.{p}_proj" in m.name for p in "kv"))
            kept += m.nbytes if whole else m.nbytes // tp
        return total, kept

    def save(self, path):
        """Every rank (it gathers); rank 0 writes a checkpoint vLLM loads."""
        from safetensors.torch import save_file

        from weightbus.integrations.hf import checkpoint_state_dict
        sd = {n: t.detach().contiguous() for n, t in checkpoint_state_dict(self.model).items()}
        if self.rank == 0:
            self.model.config.save_pretrained(path)
            save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
