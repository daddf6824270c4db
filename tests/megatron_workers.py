"""Process bodies of tests/test_megatron.py.

T Megatron trainer ranks (their own gloo world, for Megatron's parallel state) and one
rollout rank holding a Hugging Face model; weightbus moves the weights between them over
its own groups (a Rendezvous on another port)."""

from __future__ import annotations

import dataclasses
import os
import re

import torch
import torch.distributed as dist

from weightbus import CheckpointEngineRegistry, ModuleSink
from weightbus.runtime.local import Rendezvous, connect


def _hf_config(arch: str, tied: bool = False):
    import transformers
    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    if arch == "qwen2":
        return transformers.Qwen2Config(intermediate_size=128, **common)
    if arch == "qwen3":
        return transformers.Qwen3Config(intermediate_size=128, head_dim=16, **common)
    return transformers.Qwen3MoeConfig(intermediate_size=128, head_dim=16, moe_intermediate_size=32,
                                       num_experts=4, num_experts_per_tok=2, **common)


def _megatron_model(hf_config, tp: int, pp: int, ep: int, etp: int | None, vpp: int | None = None,
                    device: str = "cpu"):
    """This rank's GPTModel chunks (one, or ``vpp`` with virtual pipelining) with the local
    (non-TE) spec on CPU, and their mbridge bridge."""
    from mbridge import AutoBridge
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    torch.manual_seed(1234)
    if device != "cpu":  # Megatron's GPU initialisation draws from its own tracked RNG
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(1234)
    bridge = AutoBridge.from_config(hf_config, dtype=torch.float32)
    cfg = dataclasses.replace(bridge.config, use_cpu_initialization=device == "cpu", sequence_parallel=False,
                              masked_softmax_fusion=False, persist_layer_norm=False,
                              bias_activation_fusion=False, bias_dropout_fusion=False,
                              moe_grouped_gemm=False, pipeline_dtype=torch.float32,
                              virtual_pipeline_model_parallel_size=vpp)
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # its constructor asks CUDA for a stream
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, moe_grouped_gemm=False,
                                    qk_layernorm=cfg.qk_layernorm, normalization="RMSNorm")
    cuda = torch.Tensor.cuda  # tied embeddings over stages: Megatron all-reduces them on .cuda()
    if device == "cpu":
        torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        models = [GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
                           max_sequence_length=hf_config.max_position_embeddings,
                           pre_process=ps.is_pipeline_first_stage(ignore_virtual=vpp is None, vp_stage=v),
                           post_process=ps.is_pipeline_last_stage(ignore_virtual=vpp is None, vp_stage=v),
                           share_embeddings_and_output_weights=hf_config.tie_word_embeddings,
                           position_embedding_type="rope", rotary_base=hf_config.rope_theta, vp_stage=v)
                  for v in ([None] if vpp is None else range(vpp))]
    finally:
        torch.Tensor.cuda = cuda
    return models, bridge


def trainer_to_hf(rank: int, T: int, dist_port: int, wb_port: int, arch: str, tp: int, pp: int,
                  ep: int, etp: int | None, tied: bool = False, vpp: int | None = None,
                  backend: str = "gloo", device: str = "cpu"):
    """Two updates (weights changed between them) from a Megatron model to an HF model;
    the rollout returns its state dict's digests, trainer rank 0 the expected ones
    (mbridge's own export, independent of the source). ``device="cuda"``: every process on
    GPU 0 (with ``backend="colocated"``, the hybrid case: CUDA IPC)."""
    torch.set_num_threads(1)
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if device != "cpu":
        torch.cuda.set_device(0)
    hf_config = _hf_config(arch, tied)
    rdv = Rendezvous("127.0.0.1", wb_port, rank, T + 1, timeout=60)
    engine = CheckpointEngineRegistry.new(backend, role="trainer" if rank < T else "rollout",
                                          bucket_size=1 << 16 if device == "cpu" else 1 << 20,
                                          timeout=60, device=device)
    log = []
    if rank < T:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(dist_port))
        # (mbridge broadcasts small CPU tensors over the pipeline group too)
        dist.init_process_group("gloo" if device == "cpu" else "cpu:gloo,cuda:nccl", rank=rank, world_size=T)
        from weightbus.integrations.megatron import MegatronSource
        models, bridge = _megatron_model(hf_config, tp, pp, ep, etp, vpp, device)
        connect(engine, rdv, T, 1)
        for v in (1, 2):
            with torch.no_grad():
                for p in (p for m in models for p in m.parameters()):
                    # the two copies of tied embeddings change alike (Megatron all-reduces
                    # their gradients), the rest each its own way
                    tied = getattr(p, "shared_embedding", False)
                    shared = torch.Generator().manual_seed(v) if tied else None
                    p.add_(torch.randn(p.shape, generator=shared).to(p.device) * 0.01)
            source = MegatronSource(models, bridge)
            stats = _run(engine.send_weights(source, version=v))
            expected = _reference(models, bridge)  # (collective: every trainer rank)
            log.append({"version": stats.version, "tensors": stats.tensors, "hops": source.hops,
                        "wire": stats.wire_bytes,
                        "expected": {n: _digest(t) for n, t in expected.items()}})
        dist.destroy_process_group()
    else:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_config(hf_config).to(device)
        connect(engine, rdv, T, 1)
        sink = ModuleSink(hf)
        for _ in (1, 2):
            _run(sink.load(engine.receive_weights()))
            log.append({n: _digest(t) for n, t in hf.state_dict().items() if not re.search("rotary", n)})
    engine.finalize(destroy_group=True)
    return log


def _reference(models, bridge) -> dict[str, torch.Tensor]:
    """mbridge's own export (every rank gathers everything), with the probe's shims for the
    local spec: the expected Hugging Face tensors, independent of MegatronSource."""
    bridge._OTHER_MAPPING = dict(bridge._OTHER_MAPPING)
    bridge._OTHER_MAPPING["input_layernorm.weight"] = ["model.layers.{layer_number}.input_layernorm.weight"]
    norm = ["model.layers.{layer_number}.post_attention_layernorm.weight"]
    bridge._MLP_MAPPING = {"pre_mlp_layernorm.weight": norm, **bridge._MLP_MAPPING}

    class Renamed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            object.__setattr__(self, "inner", inner)
            object.__setattr__(self, "decoder", inner.decoder)

        @staticmethod
        def _rename(n):
            return re.sub(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight",
                          r"mlp.experts.\2.weight\1", n)

        def named_parameters(self, *a, **k):
            for n, p in self.inner.named_parameters(*a, **k):
                yield self._rename(n), p

        def state_dict(self, *a, **k):
            return {self._rename(n): v for n, v in self.inner.state_dict(*a, **k).items()}

    cur = torch.cuda.current_device
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        return {n: t.detach().clone() for n, t in bridge.export_weights([Renamed(m) for m in models])}
    finally:
        torch.cuda.current_device = cur


def _digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    import hashlib
    t = t.detach().float().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _run(coro):
    import asyncio
    return asyncio.run(coro)
