"""verl 0.9.1's own multi-turn `ToolAgentLoop`, run offline on CPU: a tokenizer made in
code (one token per byte, ChatML specials, a Qwen-style template with tools), one tool
(`add`), and a scripted engine in place of the inference server that answers each
turn as vLLM does: routes over the prompt it was sent and what it generated, less the
last token, rows of a prefix-cache hit zero, and the weights' version in its extra
fields."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, ToolListWrap
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.workers.rollout.replica import TokenOutput

BLOCK = 16  # the engine's prefix cache holds whole blocks of tokens it computed

# ChatML, tools in the system turn, tool results as a user turn (as Qwen's template);
# `{{ '\n' }}` after block tags: HF renders templates with trim_blocks
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{{ messages[0].content }}{{ '\\n' }}<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{{ '\\n' }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ tc.function.name }}", "arguments": '
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CONFIG = {
    "actor_rollout_ref": {
        "rollout": {
            "prompt_length": 4096,
            "response_length": 4096,
            "full_determinism": False,
            "multi_turn": {
                "max_user_turns": 5,
                "max_assistant_turns": 5,
                "max_parallel_calls": 1,
                "max_tool_response_length": 256,
                "tool_response_truncate_side": "middle",
                "format": "hermes",
            },
        }
    }
}


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    made = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    made.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    made.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=made, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = TEMPLATE
    return tok


class Add(BaseTool):  # type: ignore[misc]
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        return ToolResponse(text=str(parameters["a"] + parameters["b"])), 0.0, {}


ADD = OpenAIFunctionToolSchema.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "required": ["a", "b"],
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
)


def tool_call(a: int, b: int) -> str:
    call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
    return f"<tool_call>\n{call}\n</tool_call><|im_end|>"


@dataclass
class Engine:
    """The inference server's stand-in: scripted replies, and per call routes over
    `[prompt + generated - 1]` rows, drawn afresh (a prefill's choice for tokens an
    earlier call generated), zero over the blocks its prefix cache held. `own` keeps,
    per call, the rows it computed for tokens no earlier call had: the routes each
    token was first generated or read with."""

    tok: Any
    replies: list[str]
    versions: list[int]
    layers: int
    experts: int
    top_k: int
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(7))
    calls: list[tuple[int, int, np.ndarray]] = field(default_factory=list)
    own: list[np.ndarray] = field(default_factory=list)
    _seen: int = 0  # tokens of the conversation some call computed

    async def generate(self, *, prompt_ids: list[int], **kwargs: Any) -> TokenOutput:
        turn = len(self.calls)
        token_ids = self.tok.encode(self.replies[turn], add_special_tokens=False)
        rows = len(prompt_ids) + len(token_ids) - 1
        draw = self.rng.permutation
        ids = np.array(
            [[draw(self.experts)[: self.top_k] for _ in range(self.layers)] for _ in range(rows)],
            dtype=np.uint8,
        )
        ids[: self._seen // BLOCK * BLOCK] = 0  # held by the prefix cache: not computed
        self.own.append(ids[self._seen :].copy())
        self._seen = rows
        self.calls.append((len(prompt_ids), len(token_ids), ids))
        version = self.versions[turn]
        extra = {"global_steps": version, "min_global_steps": version, "max_global_steps": version}
        return TokenOutput(token_ids=token_ids, routed_experts=ids, extra_fields=extra)


async def run(loop_cls: type, engine: Engine) -> AgentLoopOutput:
    """One rollout of `loop_cls` (verl's `ToolAgentLoop` or a subclass) on `engine`:
    built inside the running event loop, as verl's worker builds it."""
    loop = loop_cls(
        trainer_config=DictConfigWrap(OmegaConf.create(CONFIG)),
        server_manager=engine,
        tokenizer=engine.tok,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(OmegaConf.create({"apply_chat_template_kwargs": {}})),
        hf_model_type="qwen2",
        tools=ToolListWrap([Add(config={}, tool_schema=ADD)]),
    )
    output: AgentLoopOutput = await loop.run(
        {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": False},
        raw_prompt=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3 + 10? Use the add tool."},
        ],
        tools_kwargs={},
        extra_info={},
    )
    return output
