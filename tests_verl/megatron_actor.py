"""verl 0.9.1's Megatron actor on the CPU: `ActorRolloutRefWorker.compute_log_prob`, its
`TrainingWorker.infer_batch` and `MegatronEngineWithLMHead` (`forward_backward_batch`,
`forward_step`, `prepare_model_inputs`, the R3 replay), run as verl runs them around a
tiny Megatron-Core GPT MoE. The worker and engine are made without their `__init__`s,
which load a Hugging Face checkpoint through mbridge on a GPU: each object gets the
attributes its `__init__` would set, the model is built here.

What stands in for what needs an accelerator:
- the core attention: Transformer Engine's, which takes the packed (THD) rows with their
  `cu_seqlens`, is Megatron's local `DotProductAttention` run sequence by sequence;
- verl's device: verl has no CPU platform (it falls back to "cuda"), so what puts a
  tensor on it on this path uses the CPU: `router_replay_utils.device_name` (fixed at
  import), `rearrange_micro_batches`' micro-batch count and the worker's `device_name`
  (`get_device_name()` in `TrainingWorker.__init__`: the loss);
- Megatron's schedule `forward_backward_no_pipelining` makes its token counter with
  `device="cuda"`: here on the CPU.
Megatron's other CUDA-only spots are `megatron_world.cpu_shims`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import types
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

import megatron_world

MAX_TOKENS = 17  # verl's infer_max_token_len_per_gpu: micro-batches of up to 17 tokens


class PackedDotProductAttention(DotProductAttention):  # type: ignore[misc]
    """Megatron's local attention over THD-packed rows, one causal sequence per
    `cu_seqlens` segment (what Transformer Engine's attention does with them)."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            mask = attention_mask
            return super().forward(query, key, value, mask, attn_mask_type, attention_bias)
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        parts = []  # each [rows, 1, heads * dim], as the unpacked forward gives
        for a, b in itertools.pairwise(cu.tolist()):
            rows = slice(a, b)
            mask = megatron_world.causal_mask(b - a)
            q, k, v = query[rows, None], key[rows, None], value[rows, None]
            parts.append(super().forward(q, k, v, mask, attn_mask_type, attention_bias))
        return torch.cat(parts)


def tiny_moe(config: Any, vocab: int = 128) -> Any:
    """`megatron_world.tiny_config`'s GPT with rotary positions (verl's packed forward
    passes no position ids) and the packed attention above."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    for layer in spec.layer_specs:
        layer.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    return GPTModel(
        config, spec, vocab_size=vocab, max_sequence_length=256, position_embedding_type="rope"
    )


class ModelConfig(types.SimpleNamespace):
    """What the worker and engine read of verl's `HFModelConfig`."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _worker_base(worker: Any) -> None:
    """What `Worker.__init__` sets for dispatch (it reads a Ray worker's environment)."""
    worker._Worker__dispatch_dp_rank = {}
    worker._Worker__collect_dp_rank = {}


def actor(model: Any, config: Any) -> Any:
    """An R3 `ActorRolloutRefWorker` whose actor runs `model` (of `config`)."""
    from verl.workers.config import McoreEngineConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    model_config = ModelConfig(
        hf_config=types.SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0),
        mtp=types.SimpleNamespace(enable=False),
        use_remove_padding=True,
        use_fused_kernels=False,
    )
    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.model_config = model_config
    engine.engine_config = McoreEngineConfig(
        use_mbridge=True,
        use_remove_padding=True,
        router_replay=EngineRouterReplayConfig(mode="R3"),
        infer_max_token_len_per_gpu=MAX_TOKENS,
    )
    engine._is_offload_param = engine.engine_config.param_offload
    engine._is_offload_optimizer = engine.engine_config.optimizer_offload
    engine.enable_routing_replay = engine.engine_config.router_replay.mode != "disabled"
    engine.mini_layer_topk_idx_list = []
    engine.tf_config = config
    engine.module = [model]
    engine.mode = None

    training = TrainingWorker.__new__(TrainingWorker)
    _worker_base(training)
    training.engine = engine
    training.model_config = model_config
    training.engine_config = engine.engine_config
    training.device_name = "cpu"
    training.flops_counter = None
    training.loss_fn = None
    training._register_dispatch_collect_info(
        mesh_name="train",
        dp_rank=engine.get_data_parallel_rank(),
        is_collect=engine.is_mp_src_rank_with_outputs(),
    )

    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    _worker_base(worker)
    worker.actor = training
    worker.enable_routing_replay = engine.enable_routing_replay
    worker.set_dispatch_collect(mesh_name="actor", **training.get_dispatch_collect())
    return worker


class _CpuTorch:
    """`torch` as Megatron's schedules see it, with tensors made on the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    def zeros(self, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*args, **kwargs)


@contextlib.contextmanager
def cpu_devices() -> Iterator[None]:
    """verl's and Megatron's tensors on this path made on the CPU, not on "cuda"."""
    from megatron.core.pipeline_parallel import schedules
    from verl.utils import seqlen_balancing
    from verl.utils.megatron import router_replay_utils

    with megatron_world.pytest_free_patch() as patch:
        patch(router_replay_utils, "device_name", "cpu")
        patch(seqlen_balancing, "get_device_name", lambda: "cpu")
        patch(schedules, "torch", _CpuTorch())
        yield


@dataclasses.dataclass
class Forward:
    """One forward of the model: its packed input ids, the sequences' bounds in them
    (`cu_seqlens`) and each MoE router's routing map (`[rows, experts]`, in layer order)."""

    input_ids: torch.Tensor
    bounds: list[int]
    maps: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def sequences(self) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
        """Each packed sequence's token ids and its rows of every router's map."""
        ids = self.input_ids.reshape(-1)
        for a, b in itertools.pairwise(self.bounds):
            yield ids[a:b].tolist(), [m[a:b] for m in self.maps]


@contextlib.contextmanager
def megatron_actor() -> Iterator[tuple[Any, list[Forward]]]:
    """In a gloo world of one (tp = pp = cp = 1): the worker, and the model's forwards
    as they happen."""
    from megatron.core.transformer.moe.router import TopKRouter
    from verl.utils.megatron.router_replay_patch import apply_router_replay_patch

    with megatron_world.cpu_shims(), megatron_world.world(), cpu_devices():
        apply_router_replay_patch()  # MegatronEngine.__init__, before the model is built
        config = megatron_world.tiny_config(
            moe_enable_routing_replay=False, enable_routing_replay=True
        )
        torch.manual_seed(0)
        model = tiny_moe(config)
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert all(r.router_replay is not None for r in routers)
        forwards: list[Forward] = []

        def begin(_m: Any, _args: Any, kwargs: dict[str, Any]) -> None:
            packed = kwargs["packed_seq_params"]
            bounds = packed.cu_seqlens_q.tolist()
            padded = packed.cu_seqlens_q_padded
            assert padded is None or padded.tolist() == bounds  # no padding at tp = cp = 1
            forwards.append(Forward(kwargs["input_ids"].detach().clone(), bounds))

        model.register_forward_pre_hook(begin, with_kwargs=True)
        for r in routers:
            r.register_forward_hook(
                lambda _m, _i, out: forwards[-1].maps.append(out[1].detach().clone())
            )
        yield actor(model, config), forwards
