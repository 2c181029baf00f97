"""vLLM on the CPU with its own routed-experts capture, for tiny MoE models built here.

vLLM's supported return path (`enable_return_routed_experts`, routes in
`CompletionOutput.routed_experts`) needs Model Runner V2, which on the CPU needs a Triton
with a CPU backend that PyPI does not have. What runs here is the V1 runner in-process,
with vLLM's own `RoutedExpertsCapturer` bound to the model's routers by vLLM's own
`bind_routed_experts_capturer` (`BaseRouter.set_capture_fn`), its buffer snapshotted
after every forward step as `AuxOutputWorkerConnector.prepare_output` does, and the rows
of each step handed to their requests by the runner's batch (`query_start_loc`) and the
tokens' positions. Each request's routes come out as vLLM's `routed_experts` would:
`[num_tokens - 1, num_hidden_layers, top_k]` (no row for the last sampled token, dense
layers as zeros), in vLLM's slot order (its CPU router's `topk(sorted=False)`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

# before vLLM is imported: the V1 runner in this process, a bounded KV cache (GiB)
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

VOCAB = 256
MAX_LEN = 128


@dataclass(frozen=True)
class Tiny:
    """A tiny MoE family: how to build it, which layers are MoE, its top-k and experts."""

    name: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int


QWEN3_MOE = Tiny("qwen3_moe", 4, [0, 1, 2, 3], 32, 4)
# DeepSeek-V3: the first layer dense, one shared expert, sigmoid gate with a bias
DEEPSEEK_V3 = Tiny("deepseek_v3", 3, [1, 2], 16, 4)


def build(tiny: Tiny, path: Path, seed: int = 0, init_std: float = 0.02) -> Any:
    """The tiny model in fp32 with seeded random weights (normal, `init_std`: HF's
    `initializer_range`), saved to `path` for vLLM; the HF model is returned (the
    trainer's side)."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": tiny.num_layers,
        "num_attention_heads": 4,
        "max_position_embeddings": MAX_LEN,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": init_std,
    }
    if tiny.name == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common,
            num_key_value_heads=2,
            head_dim=32,
            moe_intermediate_size=32,
            num_experts=tiny.num_experts,
            num_experts_per_tok=tiny.top_k,
            norm_topk_prob=True,
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        config = DeepseekV3Config(
            **common,
            num_key_value_heads=4,
            # vLLM's CPU MLA kernel is built for DeepSeek's latent width only:
            # kv_lora_rank + qk_rope_head_dim = 512 + 64
            kv_lora_rank=512,
            q_lora_rank=32,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            moe_intermediate_size=32,
            n_routed_experts=tiny.num_experts,
            num_experts_per_tok=tiny.top_k,
            n_shared_experts=1,
            first_k_dense_replace=tiny.moe_layers[0],
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            topk_method="noaux_tc",  # as DeepSeek-V3's config.json says it; vLLM reads it
            scoring_func="sigmoid",
        )
        model = DeepseekV3ForCausalLM(config)
        # a bias that matters: DeepSeek's routers choose by score + e_score_correction_bias
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.data.normal_(0, 0.05)
    model = model.float().eval()
    model.save_pretrained(path)
    return model


@dataclass
class Capture:
    """vLLM's capturer on a live engine, and each request's rows by token position."""

    capturer: Any
    rows: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    steps: int = 0

    def routes(self, request_id: str, num_tokens: int) -> np.ndarray:
        """`[num_tokens - 1, layers, K]` as vLLM's `routed_experts` (the last token never
        ran a forward pass); every position must have been captured. `request_id` is
        the output's; the engine's own id extends it (`<id>-<suffix>`)."""
        keys = [k for k in self.rows if k == request_id or k.startswith(f"{request_id}-")]
        if len(keys) != 1:
            raise AssertionError(f"{request_id}: captured under {keys} (of {list(self.rows)})")
        mine = self.rows[keys[0]]
        missing = [p for p in range(num_tokens - 1) if p not in mine]
        if missing:
            raise AssertionError(f"{request_id}: no routes captured for positions {missing}")
        return np.stack([mine[p] for p in range(num_tokens - 1)])


def runner(llm: Any) -> Any:
    """The engine's model runner (the V1 runner, in this process)."""
    return llm.collective_rpc(lambda worker: worker.model_runner)[0]


@contextmanager
def capturing(llm: Any) -> Iterator[Capture]:
    """vLLM's `RoutedExpertsCapturer` bound to the engine's routers for the block, its
    buffer snapshotted after every forward step."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )

    run = runner(llm)
    config = run.vllm_config
    capturer = RoutedExpertsCapturer(
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        vllm_config=config,
    )
    bind_routed_experts_capturer(run.get_model(), capturer)
    capture = Capture(capturer)
    forward = run._model_forward

    def snapshotting(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        num_reqs = run.input_batch.num_reqs
        starts = run.query_start_loc.np[: num_reqs + 1].copy()
        snapshot = capturer.snapshot_routing_data(int(starts[-1])).cpu().numpy()
        positions = kwargs["positions"][: int(starts[-1])].cpu().numpy()
        for i, request_id in enumerate(run.input_batch.req_ids[:num_reqs]):
            mine = capture.rows.setdefault(request_id, {})
            for row in range(int(starts[i]), int(starts[i + 1])):
                mine[int(positions[row])] = snapshot[row].copy()
        capture.steps += 1
        return out

    run._model_forward = snapshotting
    try:
        yield capture
    finally:
        del run._model_forward
        for module in run.get_model().modules():
            if hasattr(module, "set_capture_fn"):
                module.set_capture_fn(None)


def engine(path: Path, dtype: str = "float32", max_num_seqs: int = 4, **options: Any) -> Any:
    """vLLM's `LLM` on the CPU for a tiny model: token-id prompts, eager, in-process
    (`options`: more of `LLM`'s arguments). MLA models get vLLM's reference CPU backend
    (`CPU_MLA`): the AMX one, chosen by default where the CPU has AMX, takes bf16
    weights only."""
    from vllm import LLM

    return LLM(
        attention_config={"backend": "CPU_MLA"} if _mla(path) else None,
        model=str(path),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype=dtype,
        max_model_len=MAX_LEN,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=MAX_LEN * max_num_seqs,
        seed=0,
        **options,
    )


def _mla(path: Path) -> bool:
    import json

    return "kv_lora_rank" in json.loads((path / "config.json").read_text())


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, list[int]]]:
    """`(request_id, prompt + output token ids)` per prompt, greedy."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [
        (o.request_id, list(o.prompt_token_ids) + list(o.outputs[0].token_ids)) for o in outputs
    ]


@dataclass(frozen=True)
class Sampled:
    """One sampled request: its id, prompt + output token ids, the prompt's length, and
    vLLM's log-probabilities of the whole vocabulary `[new tokens, vocab]` at each
    sampled token (the distribution it was drawn from: vLLM's raw logprobs)."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    logprobs: np.ndarray


def sample(llm: Any, prompts: list[list[int]], max_tokens: int, seed: int = 0) -> list[Sampled]:
    """Sampled at temperature 1 with the whole vocabulary's logprobs per token (the
    engine needs `max_logprobs=VOCAB`)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True, logprobs=VOCAB
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    out = []
    for o in outputs:
        done = o.outputs[0]
        assert done.logprobs is not None
        assert len(done.logprobs) == len(done.token_ids)
        rows = np.full((len(done.token_ids), VOCAB), -np.inf, dtype=np.float32)
        for row, position in zip(rows, done.logprobs, strict=True):
            for token, logprob in position.items():
                row[token] = logprob.logprob
        assert np.isfinite(rows).all(), "vLLM left tokens out of the distribution"
        tokens = list(o.prompt_token_ids) + list(done.token_ids)
        out.append(Sampled(o.request_id, tokens, len(o.prompt_token_ids), rows))
    return out


def load_weights(llm: Any, weights: dict[str, torch.Tensor]) -> None:
    """New weights (checkpoint names, as `save_pretrained` writes them) into the running
    engine, in place, as RL stacks update their engines between steps: vLLM's
    `reload_weights`, then the CPU experts' prepack again. vLLM 0.32's weight-update path
    skips that prepack (`UnquantizedFusedMoEMethod._setup_kernel` runs the experts'
    `process_weights_after_loading` on the first load only), which leaves the MoE
    weights in the layout the CPU kernel does not read: every logprob after a reload
    would be off without an error (`test_vllm.py` checks them against the weights)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
    for module in runner(llm).get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
    llm.reset_prefix_cache()


def checkpoint(net: Any, path: Path) -> dict[str, torch.Tensor]:
    """`net`'s weights as its checkpoint names them (written to `path` and read back:
    transformers converts its in-memory layout to the checkpoint's on save)."""
    from safetensors.torch import load_file

    net.save_pretrained(path)
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out
