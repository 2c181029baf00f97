"""Router replay on tiny HF transformers MoE models built from configs (no downloads)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from r3store_client.replay import RouterReplay, same_sets, sigmoid_gate, softmax_gate
from r3store_client.tensors import RouteTensors


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            moe_intermediate_size=16,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            head_dim=8,
        )
        model = Qwen3MoeForCausalLM(config)
    elif kind == "olmoe":
        config = OlmoeConfig(**common, num_experts=16, num_experts_per_tok=4, norm_topk_prob=False)
        model = OlmoeForCausalLM(config)
    else:
        config = MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2)
        model = MixtralForCausalLM(config)
    for p in model.parameters():  # random init; routers visible enough to disagree
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def routes_of(ids: torch.Tensor) -> RouteTensors:
    return RouteTensors(
        ids.to(torch.int32),
        torch.ones(ids.shape, dtype=torch.bool),
        torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int32),
    )


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral", "olmoe"])
def test_recorded_routes_replay_exactly(kind: str) -> None:
    model = tiny(kind)
    replayer = RouterReplay(model)
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), replayer.record() as recorded:
        first = model(tokens).logits
    ids = recorded.ids
    assert ids.shape[:3] == (2, 10, replayer.num_layers)

    # replaying the recorded routes into a second run gives the first run's outputs
    with torch.no_grad(), replayer.replay(routes_of(ids)):
        again = model(tokens).logits
    assert torch.allclose(first, again, atol=1e-5)
    assert replayer.agreement == [1.0] * replayer.num_layers

    # a trainer whose routers drifted: replay makes every layer use exactly the
    # replayed experts (checked at the experts' input), whatever its routers say
    with torch.no_grad():
        for router in replayer.routers:
            router.weight.add_(torch.randn_like(router.weight) * 0.5)
    used: list[torch.Tensor] = []
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    handles = [
        b.register_forward_pre_hook(lambda _m, args: used.append(args[1].clone())) for b in blocks
    ]
    try:
        with torch.no_grad():
            drifted = model(tokens).logits
        live_used = list(used)
        used.clear()
        with torch.no_grad(), replayer.replay(routes_of(ids)):
            replayed = model(tokens).logits
    finally:
        for h in handles:
            h.remove()
    for layer, chosen in enumerate(used):
        assert torch.equal(chosen.reshape(2, 10, -1).to(torch.int32), ids[:, :, layer])
    assert min(replayer.agreement) < 1.0, "the drifted routers disagree somewhere"
    assert any(not torch.equal(a, b) for a, b in zip(live_used, used, strict=True))
    assert not torch.allclose(drifted, replayed)


def test_unrecorded_token_layers_fall_back_to_the_live_router() -> None:
    model = tiny("qwen3_moe")
    replayer = RouterReplay(model)
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), replayer.record() as recorded:
        first = model(tokens).logits
    ids = recorded.ids
    other = (ids + 1) % 16  # different experts everywhere
    valid = torch.zeros(ids.shape, dtype=torch.bool)  # ...but nothing recorded
    with torch.no_grad(), replayer.replay(RouteTensors(other, valid, torch.tensor([6]))):
        out = model(tokens).logits
    assert torch.allclose(first, out, atol=1e-5)


def test_router_gets_gradient_under_replay() -> None:
    model = tiny("mixtral").train()
    replayer = RouterReplay(model)
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), replayer.record() as recorded:
        model(tokens)
    drifted = (recorded.ids + 3) % 8  # experts the live router does not pick
    with replayer.replay(routes_of(drifted)):
        model(tokens).logits.sum().backward()
    for router in replayer.routers:
        assert router.weight.grad is not None
        assert router.weight.grad.abs().sum() > 0
    # the gradient reaches a replayed expert's logit even when the live top-k dropped
    # it; gathering from the live router's sparse top-k output would give it none
    logits = torch.tensor([[3.0, 2.0, 1.0, -2.0]], requires_grad=True)
    replayed = torch.tensor([[0, 3]])  # expert 3 drifted out of the live top-2
    assert not same_sets(logits.topk(2).indices, replayed).all()
    expert_out = torch.tensor([[1.0, 5.0]])  # what the two experts would contribute
    (softmax_gate(logits, replayed) * expert_out).sum().backward()
    assert logits.grad is not None
    assert logits.grad[0, 3] != 0
    ours = softmax_gate(logits.detach(), replayed)
    wrong = torch.tensor([[3.0, 2.0, 1.0, -2.0]], requires_grad=True)
    sparse = torch.zeros(1, 4).scatter(1, wrong.topk(2).indices, wrong.softmax(-1).topk(2).values)
    from_sparse = sparse.gather(1, replayed)
    assert ours[0, 1] > 0
    assert from_sparse[0, 1] == 0, "the sparse path silently zeroes the drifted expert"
    (from_sparse * expert_out).sum().backward()
    assert wrong.grad is not None
    # expert 3 contributes more (5 > 1): the R3 gate pushes its logit up; the sparse
    # path cannot see it at all and only pushes it down through the softmax's sum
    assert logits.grad[0, 3] > 0
    assert wrong.grad[0, 3] <= 0


def test_gates() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids = torch.tensor([[1, 3]])
    w = softmax_gate(logits, ids)
    want = torch.softmax(torch.tensor([1.0, -1.0]), dim=0)
    assert torch.allclose(w[0], want)
    unnormalised = softmax_gate(logits, ids, normalize=False)
    assert torch.allclose(unnormalised[0], torch.softmax(logits, -1)[0, [1, 3]])
    s = sigmoid_gate(logits, ids, normalize=True, scaling=2.5)
    raw = torch.sigmoid(torch.tensor([1.0, -1.0]))
    assert torch.allclose(s[0], raw / raw.sum() * 2.5)
