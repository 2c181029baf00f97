"""Router replay on tiny HF transformers MoE models built from configs (no downloads):
every family replay knows replays its own routes to identical outputs, replays drifted
routers onto exactly the given experts with gradient reaching the router, and any
other router is refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_tiny import COMMON, TINY
from r3store.errors import InvalidRoutes
from r3store_client.hf_routers import FAMILIES
from r3store_client.replay import RouterReplay
from r3store_client.tensors import RouteTensors

KNOWN = [name for name, (_t, _m, router, _k) in TINY.items() if router in FAMILIES]
UNKNOWN = [name for name, (_t, _m, router, _k) in TINY.items() if router not in FAMILIES]
BIASES = ("e_score_correction_bias", "expert_bias")


def tiny(name: str, dtype: torch.dtype = torch.float32) -> Any:
    model_type, auto, _router, kwargs = TINY[name]
    config = CONFIG_MAPPING[model_type](**{**COMMON, **kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, auto).from_config(config, dtype=dtype)
    with torch.no_grad():  # routers visible enough to disagree; biases that matter
        for module in model.modules():
            if type(module).__name__ == TINY[name][2]:
                for p in module.parameters():
                    p.normal_(0.0, 0.5)
            for buffer_name, buffer in module.named_buffers(recurse=False):
                if buffer_name in BIASES or buffer_name.endswith("correction_bias"):
                    buffer.normal_(0.0, 0.05)
            for param_name, param in module.named_parameters(recurse=False):
                if param_name in BIASES or param_name.endswith("correction_bias"):
                    param.normal_(0.0, 0.05)
    return model.eval()


def run(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens)
    result: torch.Tensor = out.logits if hasattr(out, "logits") else out.last_hidden_state
    return result


def routes_of(ids: torch.Tensor) -> RouteTensors:
    return RouteTensors(
        ids.to(torch.int32),
        torch.ones(ids.shape, dtype=torch.bool),
        torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int32),
    )


def chosen_by_routers(replayer: RouterReplay) -> tuple[list[torch.Tensor], list[Any]]:
    seen: list[torch.Tensor] = []
    handles = [
        r.register_forward_hook(lambda _m, _i, out: seen.append(out[2].clone()))
        for r in replayer.routers
    ]
    return seen, handles


def drift(replayer: RouterReplay) -> None:
    with torch.no_grad():
        for router in replayer.routers:
            for p in router.parameters():
                p.add_(torch.randn_like(p))


TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", KNOWN)
def test_a_family_replays_itself_exactly(name: str) -> None:
    model = tiny(name)
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        first = run(model, TOKENS)
    ids = recorded.ids
    assert ids.shape[:3] == (2, 8, replayer.num_layers)
    with torch.no_grad(), replayer.replay(routes_of(ids)):
        again = run(model, TOKENS)
    assert torch.equal(first, again)  # the model's own gate, bit for bit
    assert replayer.agreement == [1.0] * replayer.num_layers

    # routers that drifted: each one runs exactly the replayed experts
    drift(replayer)
    with torch.no_grad():
        drifted = run(model, TOKENS)
    seen, handles = chosen_by_routers(replayer)
    with torch.no_grad(), replayer.replay(routes_of(ids)):
        replayed = run(model, TOKENS)
    for handle in handles:
        handle.remove()
    for layer, chosen in enumerate(seen):
        assert torch.equal(chosen.reshape(2, 8, -1).to(torch.int32), ids[:, :, layer])
    assert min(replayer.agreement) < 1.0, "the drifted routers disagree somewhere"
    assert not torch.equal(drifted, replayed)


@pytest.mark.parametrize("name", ["mixtral", "minimax_m2", "deepseek_v3", "lfm2_moe", "jamba"])
def test_exact_in_bfloat16(name: str) -> None:
    model = tiny(name, torch.bfloat16)
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        first = run(model, TOKENS)
    with torch.no_grad(), replayer.replay(routes_of(recorded.ids)):
        again = run(model, TOKENS)
    assert torch.equal(first, again)


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_the_router_learns_under_replay(name: str) -> None:
    model = tiny(name).train()
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        run(model, TOKENS)
    experts = replayer.experts[0]
    forced = (recorded.ids + 1) % experts  # experts the live router did not pick...
    forced[..., 1] = (forced[..., 0] + 1) % experts  # ...distinct within each row
    with replayer.replay(routes_of(forced)):
        run(model, TOKENS).float().pow(2).mean().backward()
    for router in replayer.routers:
        grads = [p.grad for p in router.parameters() if p.requires_grad]
        assert grads
        assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_unrecorded_token_layers_fall_back_to_the_live_router() -> None:
    model = tiny("qwen3_moe")
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        first = run(model, TOKENS)
    ids = recorded.ids
    other = (ids + 1) % replayer.experts[0]
    valid = torch.ones(ids.shape, dtype=torch.bool)
    valid[1, 4:] = False  # the engine recorded nothing here...
    mixed = torch.where(valid, ids, other)  # ...and these would be wrong if replayed
    with torch.no_grad(), replayer.replay(RouteTensors(mixed, valid, torch.tensor([8, 8]))):
        out = run(model, TOKENS)
    assert torch.equal(first, out)


def test_partial_routes_are_refused() -> None:
    model = tiny("mixtral")
    replayer = RouterReplay(model)
    ids = torch.zeros((1, 8, replayer.num_layers, 2), dtype=torch.int32)
    ids[..., 1] = 1
    valid = torch.ones(ids.shape, dtype=torch.bool)
    valid[0, 3, 1, 1] = False
    partial = RouteTensors(ids, valid, torch.tensor([8]))
    with pytest.raises(InvalidRoutes, match="token 3, layer 1 has fewer than K"):
        replayer.replay(partial).__enter__()


def test_routes_of_another_shape_are_refused() -> None:
    model = tiny("olmoe")
    replayer = RouterReplay(model)
    with pytest.raises(InvalidRoutes, match=r"the model has 2 MoE layers"):
        replayer.replay(routes_of(torch.zeros((1, 8, 3, 2), dtype=torch.int32))).__enter__()
    too_big = torch.zeros((1, 8, 2, 2), dtype=torch.int32)
    too_big[..., 0] = 9  # 4 experts
    with pytest.raises(InvalidRoutes, match="experts the model does not have"):
        replayer.replay(routes_of(too_big)).__enter__()
    short = routes_of(torch.tensor([[[[0, 1], [1, 2]]] * 4]))  # 4 tokens for an input of 8
    with pytest.raises(RuntimeError, match="not one"), torch.no_grad(), replayer.replay(short):
        run(model, TOKENS)


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_routers_are_refused(name: str) -> None:
    model = tiny(name)
    with pytest.raises(ValueError, match="is not one replay knows the gate of") as caught:
        RouterReplay(model)
    assert "Qwen3MoeTopKRouter" in str(caught.value)  # the list of the known ones
