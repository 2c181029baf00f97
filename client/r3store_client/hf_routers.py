"""The HF transformers MoE routers that replay knows, and their gates (no torch needed).

Every router here is a module whose forward returns `(router_logits, top_k_weights,
top_k_index)` and makes exactly one final top-k over all experts; replay substitutes
that one top-k (`r3store_client.replay`), so the gate weights are computed by the
model's own code at the replayed experts (dtype casts, renormalisation, epsilons,
scaling factors and all). Checked against transformers 5.24; each family replays
itself to identical logits in the tests. Any other router class is refused, because
a replay that applies the wrong gate changes the model's output without an error.

`ranked`: the router's final top-k is `torch.topk`'s default, sorted by the score it
chooses by, so its top-k ids come best first (rank order). The families with group-limited
or biased choice (DeepSeek-V2/V3, GLM-4.5, dots.llm1, Kimi-Linear, MiniMax-M2) take
`sorted=False`: their slots promise no order (`convert.from_hf_router`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One router family: its gate in words, whether its top-k ids come in rank order,
    and where its `[E, H]` weight lives."""

    gate: str
    weight: str = "weight"
    ranked: bool = True


SOFTMAX_RENORM = "softmax over all experts, gathered at the top-k, renormalised if norm_topk_prob"
SOFTMAX_ALWAYS = "softmax over all experts, gathered at the top-k, always renormalised"
SIGMOID_BIAS_GROUPS = (
    "sigmoid scores; e_score_correction_bias and group-limited top-k (n_group, topk_group) "
    "choose, the unbiased scores are the weights, renormalised if norm_topk_prob (+1e-20), "
    "times routed_scaling_factor"
)

FAMILIES: dict[str, Family] = {
    # Qwen / OLMoE: softmax(dtype=float), top-k, optional renormalisation, to logits dtype
    "Qwen2MoeTopKRouter": Family(SOFTMAX_RENORM),
    "Qwen3MoeTopKRouter": Family(SOFTMAX_RENORM),
    "Qwen3NextTopKRouter": Family(SOFTMAX_RENORM),
    "OlmoeTopKRouter": Family(SOFTMAX_RENORM),
    "FlexOlmoTopKRouter": Family(SOFTMAX_RENORM),
    "Qwen3VLMoeTextTopKRouter": Family(SOFTMAX_ALWAYS),
    # Mixtral / MiniMax: softmax of float logits, top-k, renormalised, kept in float32
    "MixtralTopKRouter": Family(SOFTMAX_ALWAYS + ", kept in float32"),
    "MiniMaxTopKRouter": Family(SOFTMAX_ALWAYS + ", kept in float32"),
    # DeepSeek-V3 and its siblings (GLM-4.5, GLM-4.5V, dots.llm1, Kimi-Linear)
    "DeepseekV3TopkRouter": Family(SIGMOID_BIAS_GROUPS, ranked=False),
    "Glm4MoeTopkRouter": Family(SIGMOID_BIAS_GROUPS, ranked=False),
    "Glm4vMoeTextTopkRouter": Family(SIGMOID_BIAS_GROUPS, ranked=False),
    "Dots1TopkRouter": Family(SIGMOID_BIAS_GROUPS, ranked=False),
    "KimiLinearTopkRouter": Family(SIGMOID_BIAS_GROUPS, ranked=False),
    "DeepseekV2TopkRouter": Family(
        "softmax over all experts (group-limited: scores outside the chosen groups are 0), "
        "gathered at the top-k, never renormalised, times routed_scaling_factor",
        ranked=False,
    ),
    "MiniMaxM2TopKRouter": Family(
        "sigmoid of float logits; the block's e_score_correction_bias chooses, the unbiased "
        "scores are the weights, always renormalised (no epsilon), kept in float32",
        ranked=False,
    ),
    "Lfm2MoeTopKRouter": Family(
        "sigmoid in the model's dtype; the block's expert_bias chooses (use_expert_bias), "
        "renormalised if norm_topk_prob (+1e-6), times routed_scaling_factor"
    ),
    "JambaTopKRouter": Family(
        "softmax over all experts (float), gathered at the top-k, never renormalised"
    ),
    "GptOssTopKRouter": Family(
        "top-k of the raw logits (with the router's bias), softmax over those k"
    ),
    "GraniteMoeTopKRouter": Family("top-k of float logits, softmax over those k"),
    "GraniteMoeSharedTopKRouter": Family("top-k of float logits, softmax over those k"),
    "GraniteMoeHybridTopKRouter": Family("top-k of float logits, softmax over those k"),
    "Ernie4_5_MoeTopKRouter": Family(
        "float softmax; the correction bias chooses, renormalised (clamped at moe_norm_min)"
    ),
    "HunYuanMoEV1Gate": Family(
        "softmax over all experts (float), gathered at the top-k, always renormalised",
        weight="wg.weight",
    ),
}


def supported() -> str:
    """The router classes replay knows, for error messages."""
    return ", ".join(sorted(FAMILIES))
