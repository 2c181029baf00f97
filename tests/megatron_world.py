"""Real Megatron-Core on CPU, for the replay tests: gloo process groups, Megatron's own
parallel state, and the three CUDA-only spots shimmed (router gating moves its weight
to CUDA, `torch.cuda.current_device`, the CUDA RNG tracker). Everything else is
Megatron's code: `TopKRouter`, `RouterReplay`, the MoE layer, `GPTModel`.

`spawn(world, fn, *args, tp=.., cp=.., pp=..)` runs `fn(*args)` on every rank of a
world of gloo processes and returns each rank's result.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def quiet() -> None:
    """Megatron warns at import that Transformer Engine and Apex are absent."""
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", message=r".*torch\.jit\.script_method.*")
    warnings.filterwarnings("ignore", message=r".*Transformer Engine.*")


class _Tracker:
    """The CUDA RNG tracker's interface, on the CPU (dropout is 0 in these models)."""

    def fork(self, name: str = "") -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def get_states(self) -> dict[str, Any]:
        return {}

    def set_states(self, states: dict[str, Any]) -> None:
        pass

    def add(self, *args: Any, **kwargs: Any) -> None:
        pass

    def is_initialized(self) -> bool:
        return True


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Run Megatron's MoE on the CPU: the same linear gating without the move to CUDA, a
    CPU device, and no CUDA RNG states to save for recomputation."""
    quiet()
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe.router import Router

    def gating(self: Any, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.config.moe_router_dtype == "fp32" else x.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)

    tracker = _Tracker()
    with pytest_free_patch() as patch:
        patch(Router, "gating", gating)
        patch(torch.cuda, "current_device", lambda: "cpu")
        patch(tp_random, "get_cuda_rng_tracker", lambda *a, **k: tracker)
        patch(tp_random, "_get_cuda_rng_state", lambda *a, **k: None)  # recomputation
        patch(tp_random, "_set_cuda_rng_state", lambda *a, **k: None)
        patch(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: tracker)
        yield


@contextlib.contextmanager
def pytest_free_patch() -> Iterator[Callable[[Any, str, Any], None]]:
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    try:
        yield patch
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def world(
    rank: int = 0,
    size: int = 1,
    port: int | None = None,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    vp: int | None = None,
) -> Iterator[None]:
    """This process as rank `rank` of a gloo world with Megatron's parallel state."""
    from megatron.core import parallel_state

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port or free_port()}",
        rank=rank,
        world_size=size,
    )
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            virtual_pipeline_model_parallel_size=vp,
        )
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# what every MoE here is built with: routing replay on, no load balancing, the
# allgather dispatcher, weights made on the CPU, no dropout, no biases
REPLAY_ON_CPU: dict[str, Any] = dict(
    moe_enable_routing_replay=True,
    moe_router_load_balancing_type="none",
    moe_aux_loss_coeff=0.0,
    moe_token_dispatcher_type="allgather",
    use_cpu_initialization=True,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    add_bias_linear=False,
)


def tiny_config(**overrides: Any) -> Any:
    """A tiny MoE transformer: 3 layers, the first dense, 8 experts, top-2."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    options: dict[str, Any] = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=16,
        num_moe_experts=8,
        moe_router_topk=2,
        moe_layer_freq=[0, 1, 1],
        **REPLAY_ON_CPU,
    )
    options.update(overrides)
    return TransformerConfig(**options)


def tiny_gpt(config: Any, vocab: int = 64, seq: int = 32, vp_stage: int | None = None) -> Any:
    """A `GPTModel` of `config` with Megatron's local (no Transformer Engine) layers and
    learned absolute positions (rotary embeddings need CUDA)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
    return GPTModel(
        config,
        spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        position_embedding_type="learned_absolute",
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )


def causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)[None, None]


def _child(
    rank: int,
    size: int,
    port: int,
    parallel: dict[str, Any],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    out: str,
) -> None:
    torch.set_num_threads(1)
    with cpu_shims(), world(rank, size, port, **parallel):
        result = fn(*args)
    Path(out, f"{rank}.pickle").write_bytes(pickle.dumps(result))


def spawn(size: int, fn: Callable[..., Any], *args: Any, **parallel: Any) -> list[Any]:
    """`fn(*args)` on each rank of a `size`-process gloo world; the ranks' results."""
    with tempfile.TemporaryDirectory(prefix="r3store-megatron-") as out:
        env = dict(os.environ)
        mp.start_processes(
            _child,
            args=(size, free_port(), parallel, fn, args, out),
            nprocs=size,
            join=True,
            start_method="spawn",
        )
        os.environ.update(env)
        return [pickle.loads(Path(out, f"{r}.pickle").read_bytes()) for r in range(size)]
