"""The gates of MoE routers: what turns a router's logits into the weights of its
chosen experts (torch required).

Routers differ in their gate (softmax or sigmoid, renormalised or not, correction biases
that only choose), and a replay into a trainer model whose gate is not the one the
routes were recorded with changes its output without an error. So both replays check,
when they attach, the gate the trainer's model applies (`hf_gate` for HF transformers
routers, `megatron_gate` for a Megatron config) against that of the model the spec
names (`model_gate`, from `MODEL_GATES`): `check_gate`.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from r3store_client.hf_routers import FAMILIES, SIGMOID_BIAS_GROUPS
from r3store_client.token_check import GateNotChecked

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Gate:
    """A router's gate in the terms that change a replayed forward: the score function
    (`softmax` or `sigmoid`), whether the chosen experts' weights are renormalised to
    sum to one (softmax over only the top-k logits is the same), and whether a bias
    that only chooses experts (DeepSeek-V3's `e_score_correction_bias`) is added."""

    score: str
    normalised: bool
    selection_bias: bool

    def __str__(self) -> str:
        norm = "renormalised" if self.normalised else "not renormalised"
        bias = ", a bias that only chooses" if self.selection_bias else ""
        return f"{self.score}, {norm}{bias}"


SOFTMAX_NORMALISED = Gate("softmax", True, False)
SOFTMAX_PLAIN = Gate("softmax", False, False)
SIGMOID_BIASED = Gate("sigmoid", True, True)

# The gates of the released MoE models, by a pattern of their names (lower case, `_`
# and spaces as `-`), the first that matches: what a namespace's spec `model` names is
# checked against the gate the trainer's model applies. Names matching none are not
# checked (a warning says so).
MODEL_GATES: tuple[tuple[str, Gate], ...] = (
    (r"deepseek-(v3|r1|prover-v2)|kimi-k2|moonlight|glm-4\.[5-7]", SIGMOID_BIASED),
    (r"deepseek-(coder-)?v2", SOFTMAX_PLAIN),  # group-limited, times a scaling factor
    (r"minimax-m2", SIGMOID_BIASED),
    (r"lfm2", SIGMOID_BIASED),
    (r"ernie-4\.5", Gate("softmax", True, True)),
    (r"qwen1\.5-moe|qwen2-moe|qwen2-57b", SOFTMAX_PLAIN),
    (r"qwen3", SOFTMAX_NORMALISED),
    (r"mixtral|gpt-oss|minimax|granite|hunyuan", SOFTMAX_NORMALISED),
    (r"olmoe|jamba", SOFTMAX_PLAIN),
)


def model_gate(name: str) -> Gate | None:
    """The gate of the model `name` (a hub id or any name holding one), if known."""
    key = re.sub(r"[\s_]+", "-", name.strip().lower())
    for pattern, gate in MODEL_GATES:
        if re.search(pattern, key):
            return gate
    return None


def check_gate(model: str, gate: Gate, where: str) -> None:
    """Refuse a trainer model whose gate is not the one of the model the routes were
    recorded with (the spec's `model`, when set); warn (`GateNotChecked`) when that
    name is not one whose gate is known."""
    if not model:
        return
    want = model_gate(model)
    if want is None:
        warnings.warn(
            f"the routes' model {model!r} is not one whose gate replay knows: the gate of "
            f"{where} ({gate}) is not checked against it",
            GateNotChecked,
            stacklevel=3,
        )
        return
    if want != gate:
        raise ValueError(
            f"the model does not match the routes: the routes are of {model!r}, whose gate "
            f"is {want}; {where} applies {gate}"
        )


_ALWAYS_NORMALISED = {
    "Qwen3VLMoeTextTopKRouter",
    "MixtralTopKRouter",
    "MiniMaxTopKRouter",
    "GptOssTopKRouter",
    "GraniteMoeTopKRouter",
    "GraniteMoeSharedTopKRouter",
    "GraniteMoeHybridTopKRouter",
    "HunYuanMoEV1Gate",
}


def hf_gate(router: nn.Module, config: Any) -> Gate:
    """The gate of an HF router replay knows (`FAMILIES`), with its model's settings."""
    name = type(router).__name__

    def flag(attr: str, default: bool) -> bool:
        value = getattr(router, attr, None)
        if value is None and config is not None:
            value = getattr(config, attr, None)
        return default if value is None else bool(value)

    if name in _ALWAYS_NORMALISED:
        return SOFTMAX_NORMALISED
    if name == "Ernie4_5_MoeTopKRouter":
        return Gate("softmax", True, True)
    if name in ("DeepseekV2TopkRouter", "JambaTopKRouter"):
        return SOFTMAX_PLAIN
    if name == "MiniMaxM2TopKRouter":
        return SIGMOID_BIASED
    if name == "Lfm2MoeTopKRouter":
        return Gate("sigmoid", flag("norm_topk_prob", False), flag("use_expert_bias", False))
    if FAMILIES[name].gate == SIGMOID_BIAS_GROUPS:
        return Gate("sigmoid", flag("norm_topk_prob", False), True)
    return Gate("softmax", flag("norm_topk_prob", False), False)  # the Qwen / OLMoE kind


def megatron_gate(config: Any) -> Gate:
    """The gate a Megatron router of `config` applies (`topk_routing_with_score_function`):
    softmax before top-k (`moe_router_pre_softmax`) keeps the k probabilities as they
    are, softmax after it normalises them; sigmoid scores are normalised for top-k > 1;
    `moe_router_enable_expert_bias` adds a bias that only chooses."""
    score = config.moe_router_score_function
    if score == "softmax":
        normalised = not config.moe_router_pre_softmax or config.moe_router_topk == 1
    else:
        normalised = config.moe_router_topk > 1
    return Gate(score, normalised, bool(config.moe_router_enable_expert_bias))
