"""verl's own agent loop on the CPU: `AgentLoopWorker.generate_sequences` running verl's
`SingleTurnAgentLoop`, its padding (`_agent_loop_postprocess`) and batching
(`_postprocess`), with a tokenizer built here and a stand-in for the one part that needs
a GPU: the vLLM/SGLang server behind `LLMServerClient.generate`, which answers a
`TokenOutput` as `vLLMHttpServer.generate` does (`routed_experts`: the engine's top-k
ids, a row per token it fed through the model, `[rows, L, K]`)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from typing import Any

import numpy as np

from r3store.spec import RouteSpec
from r3store_client import Client

LAYERS, EXPERTS, TOP_K = 2, 8, 2  # the MoE layers of `tiny_config` below
PROMPT_LENGTH, RESPONSE_LENGTH = 16, 12
WORDS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"] + [
    f"w{i}" for i in range(120)
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def tokenizer() -> Any:
    """A word-level HF tokenizer with a chat template (no hub download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf.chat_template = TEMPLATE
    return hf


class Engine:
    """Stands in for the rollout server: a deterministic response per prompt and the
    routes of every token but the last sampled one (vLLM's `routed_experts`), distinct
    experts per token-layer in the engine's (score) order. `short` prompts get routes
    for fewer tokens (a multi-turn loop stops recording at its last generation)."""

    def __init__(self, short: int = 0) -> None:
        self.short = short
        self.calls = 0

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        self.calls += 1
        seed = int.from_bytes(hashlib.sha256(str(prompt_ids).encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        n = int(rng.integers(3, RESPONSE_LENGTH + 4))  # some beyond response_length
        response = [int(t) for t in rng.integers(6, len(WORDS), n)]
        rows = len(prompt_ids) + n - 1 - (self.short if seed % 3 == 0 else 0)
        routes = np.stack(
            [
                np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)])
                for _ in range(rows)
            ]
        ).astype(np.int32)
        return TokenOutput(
            token_ids=response, log_probs=None, routed_experts=routes, stop_reason="completed"
        )


def config() -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": PROMPT_LENGTH,
                    "response_length": RESPONSE_LENGTH,
                    "temperature": 1.0,
                    "top_p": 1.0,
                    "top_k": -1,
                    "calculate_log_probs": False,
                    "agent": {"default_agent_loop": "single_turn_agent"},
                    "val_kwargs": {},
                    "multi_turn": {},
                }
            },
            "data": {},
        }
    )


def worker(cls: type[Any], engine: Engine, **attrs: Any) -> Any:
    """An `AgentLoopWorker` (or subclass) as its `__init__` leaves it, without the parts
    that need a model on disk and Ray: the rollout config, the tokenizer, no processor,
    no tools, no reward workers, no distillation; `engine` as its LLM client."""
    from verl.experimental.agent_loop import single_turn_agent_loop  # registers it
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.utils.rollout_trace import RolloutTraceConfig

    assert single_turn_agent_loop.SingleTurnAgentLoop
    cfg = config()
    w = cls.__new__(cls)
    w.config = cfg
    w.rollout_config = cfg.actor_rollout_ref.rollout
    w.llm_client = engine
    w.teacher_client = None
    w.reward_loop_worker_handles = None
    w.tokenizer = tokenizer()
    w.processor = None
    w.hf_model_type = None
    w.dataset_cls = RLHFDataset
    w.mm_processor_kwargs = {}
    w.distillation_enabled = False
    w.tools = []
    for name, value in attrs.items():
        setattr(w, name, value)
    RolloutTraceConfig.init("r3store", "verl", None, False, None)
    # a word-level test tokenizer has no model type: verl says it uses its default builder
    logging.getLogger("verl.utils.tokenizer.continuous_token_wiring").setLevel(logging.ERROR)
    return w


def prompts(groups: int, n: int, step: int = 0) -> Any:
    """A GRPO step's generation batch: `groups` prompts, each `n` times (interleaved, as
    `ray_trainer` repeats them), with their `uid`."""
    from verl.protocol import DataProto

    raw, uids = [], []
    for g in range(groups):
        words = " ".join(f"w{(7 * g + j + step) % 100}" for j in range(1 + (3 * g) % 9))
        for _ in range(n):
            raw.append([{"role": "user", "content": words}])
            uids.append(f"step{step}-prompt{g}")
    raw_prompt = np.empty(len(raw), dtype=object)
    raw_prompt[:] = raw
    return DataProto.from_dict(
        non_tensors={"raw_prompt": raw_prompt, "uid": np.array(uids, dtype=object)},
        meta_info={"global_steps": step},
    )


def generate(w: Any, batch: Any) -> Any:
    return asyncio.run(w.generate_sequences(batch))


def clone(data: Any) -> Any:
    """A deep copy of a DataProto."""
    from verl.protocol import DataProto

    return DataProto(
        batch=data.batch.clone(),
        non_tensor_batch={k: v.copy() for k, v in data.non_tensor_batch.items()},
        meta_info=dict(data.meta_info),
    )


_names = itertools.count()


def make_namespace(client: Client, ordered: bool) -> str:
    """A fresh namespace for the tiny model's routes."""
    name = f"verl{next(_names)}"
    client.create_namespace(name, RouteSpec(LAYERS, EXPERTS, TOP_K, ordered=ordered))
    return name
