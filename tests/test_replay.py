"""Router replay on tiny HF transformers MoE models built from configs (no downloads):
every family replay knows replays its own routes to identical outputs, replays drifted
routers onto exactly the given experts with gradient reaching the router, and any
other router is refused. Routes carry their token ids: a batch in another order or
padded otherwise than its routes raises naming the trajectory (routes through a real
r3store server); the spec's shape and model's gate are checked at attach."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from hf_tiny import COMMON, TINY
from http_helpers import KEYS, ServerProcess
from r3store.errors import InvalidRoutes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store_client import Client
from r3store_client.convert import from_hf_router
from r3store_client.hf_routers import FAMILIES
from r3store_client.reader import TrainerReader
from r3store_client.replay import RouterReplay
from r3store_client.tensors import CompactRoutes, Origin, RouteTensors
from r3store_client.token_check import GateNotChecked, TokenMismatch, TokensNotChecked

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


TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def routes_of(ids: torch.Tensor, tokens: torch.Tensor | None = TOKENS) -> RouteTensors:
    """Every token-layer recorded, the routes of `tokens` (None: no token ids)."""
    names = tuple(f"h{b}" for b in range(ids.shape[0]))
    return RouteTensors(
        ids.to(torch.int32),
        torch.ones(ids.shape, dtype=torch.bool),
        torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int32),
        None,
        None if tokens is None else tokens.to(torch.int32),
        Origin(None, names),
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
    routes = RouteTensors(mixed, valid, torch.tensor([8, 8]), None, TOKENS.to(torch.int32))
    with torch.no_grad(), replayer.replay(routes):
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
    short = routes_of(torch.tensor([[[[0, 1], [1, 2]]] * 4]), None)  # 4 tokens, an input of 8
    unchecked = RouterReplay(model, check_tokens=False)
    with pytest.raises(RuntimeError, match="not one"), torch.no_grad(), unchecked.replay(short):
        run(model, TOKENS)


@pytest.mark.parametrize("name", UNKNOWN)
def test_unknown_routers_are_refused(name: str) -> None:
    model = tiny(name)
    with pytest.raises(ValueError, match="is not one replay knows the gate of") as caught:
        RouterReplay(model)
    assert "Qwen3MoeTopKRouter" in str(caught.value)  # the list of the known ones


@pytest.mark.parametrize("name", KNOWN)
def test_a_familys_slot_order_is_what_its_top_k_promises(name: str) -> None:
    """`Family.ranked`, and so `from_hf_router`'s slot order, held against the router's
    own code in the installed transformers: rank order exactly when its top-k is sorted
    (`torch.topk`'s default), none where it takes `sorted=False`."""
    model = tiny(name)
    router = next(m for m in model.modules() if type(m).__name__ == TINY[name][2])
    source = inspect.getsource(type(router))
    assert "topk(" in source  # the router's own top-k, not a helper's elsewhere
    ranked = "sorted=False" not in source
    assert FAMILIES[type(router).__name__].ranked == ranked
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        run(model, TOKENS)
    layers = [recorded.ids[0, :, i] for i in range(replayer.num_layers)]
    write = from_hf_router("h", layers, router=router)
    assert (write.slot_order, write.producer) == ("rank" if ranked else "set", TINY[name][2])


# ---- the token check, through a real server


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    server = ServerProcess(Path(tmp_path_factory.mktemp("server")), None)
    try:
        with Client(server.url, KEYS["admin"]) as made:
            yield made
    finally:
        server.stop()


def through_r3store(
    client: Client,
    namespace: str,
    ids: torch.Tensor,
    lengths: list[int],
    tokens: torch.Tensor | None,
) -> CompactRoutes:
    """Recorded `[B, T, L, K]` routes stored (with the tokens' ids unless None) and
    fetched back as a trainer does."""
    _b, _t, layers, k = ids.shape
    client.create_namespace(namespace, RouteSpec(layers, 4, k, ordered=True))  # 4 experts
    writes = [
        TrajectoryWrite(
            f"{namespace}{b}",
            n,
            topk=ids[b, :n].numpy(),
            token_ids=None if tokens is None else tokens[b, :n].numpy().astype(np.int32),
        )
        for b, n in enumerate(lengths)
    ]
    client.put(namespace, writes)
    routes = TrainerReader(client, namespace).fetch([w.trajectory_id for w in writes])
    assert isinstance(routes, CompactRoutes)
    return routes


def test_replay_checks_the_input_ids_against_the_stored_tokens(client: Client) -> None:
    """A batch of the routes' tokens replays exactly; the same batch in another order,
    left-padded where the routes are right-padded, or given another way raises at the
    end of the block naming the trajectory and its first differing token."""
    model = tiny("qwen3_moe")  # 4 experts, top-2
    replayer = RouterReplay(model)
    batch = TOKENS.clone()
    batch[1, 6:] = 0  # sequence 1 has 6 tokens: right padding
    with torch.no_grad(), replayer.record() as recorded:
        first = run(model, batch)
    routes = through_r3store(client, "hf", recorded.ids, [8, 6], batch)
    assert routes.tokens is not None
    assert routes.origin.trajectory_ids == ("hf0", "hf1")
    with torch.no_grad(), replayer.replay(routes):
        assert torch.equal(run(model, batch), first)

    differs = int((batch[0] != batch[1]).nonzero()[0, 0])
    with (
        pytest.raises(
            TokenMismatch,
            match=rf"trajectory 'hf0' \(sequence 0 of the micro-batch\): token {differs} is "
            rf"{int(batch[1, differs])} in the batch but {int(batch[0, differs])} in the "
            r"routes stored in namespace 'hf'",
        ),
        torch.no_grad(),
        replayer.replay(routes),
    ):
        run(model, batch.flip(0))
    left = batch.clone()
    left[1] = torch.cat([torch.zeros(2, dtype=torch.long), batch[1, :6]])
    with (
        pytest.raises(TokenMismatch, match=r"trajectory 'hf1' .*: token 0 is 0 in the batch"),
        torch.no_grad(),
        replayer.replay(routes),
    ):
        run(model, left)
    with (  # the input ids given, the model called with embeddings
        pytest.raises(TokenMismatch, match="'hf0'"),
        torch.no_grad(),
        replayer.replay(routes, input_ids=batch.flip(0)),
    ):
        model(inputs_embeds=model.get_input_embeddings()(batch.flip(0)))
    with (
        pytest.raises(InvalidRoutes, match=r"the input ids are \[2, 7\], the routes' stored"),
        torch.no_grad(),
        replayer.replay(routes),
    ):
        run(model, batch[:, :7])
    unchecked = RouterReplay(model, check_tokens=False)  # the order rests on the caller
    with torch.no_grad(), unchecked.replay(routes):
        run(model, batch.flip(0))


def test_what_replay_cannot_check_it_says_once(client: Client) -> None:
    """Routes stored without token ids, and a model called without input ids: replayed
    unchecked, and said once each (naming the namespace); nothing said when the check
    is turned off."""
    model = tiny("olmoe")
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        run(model, TOKENS)
    bare = through_r3store(client, "hf-untokened", recorded.ids, [8, 8], None)
    tokened = through_r3store(client, "hf-embeds", recorded.ids, [8, 8], TOKENS)
    embeds = model.get_input_embeddings()(TOKENS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with torch.no_grad(), replayer.replay(bare):
                run(model, TOKENS)
            with torch.no_grad(), replayer.replay(tokened):
                model(inputs_embeds=embeds)
        quiet = RouterReplay(model, check_tokens=False)
        with torch.no_grad(), quiet.replay(bare):
            run(model, TOKENS)
    said = [str(w.message) for w in caught if issubclass(w.category, TokensNotChecked)]
    assert len(said) == 2
    assert said[0].startswith("namespace 'hf-untokened': the routes were stored without token")
    assert said[1].startswith("namespace 'hf-embeds': the model was called without input_ids")


# ---- the spec and the gate, at attach

GATES = {  # each family's tiny model, and a released model of its gate
    "qwen2_moe": "Qwen/Qwen1.5-MoE-A2.7B",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B",
    "qwen3_next": "Qwen/Qwen3-Next-80B-A3B-Instruct",
    "olmoe": "allenai/OLMoE-1B-7B-0924",
    "qwen3_vl_moe": "Qwen/Qwen3-VL-30B-A3B-Instruct",
    "mixtral": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "minimax": "MiniMaxAI/MiniMax-Text-01",
    "deepseek_v3": "moonshotai/Kimi-K2-Instruct",
    "glm4_moe": "zai-org/GLM-4.5-Air",
    "glm4v_moe": "zai-org/GLM-4.5V",
    "deepseek_v2": "deepseek-ai/DeepSeek-V2-Lite",
    "minimax_m2": "MiniMaxAI/MiniMax-M2",
    "lfm2_moe": "LiquidAI/LFM2-8B-A1B",
    "jamba": "ai21labs/AI21-Jamba-Mini-1.5",
    "gpt_oss": "openai/gpt-oss-20b",
    "granitemoe": "ibm-granite/granite-3.1-3b-a800m-instruct",
    "ernie4_5_moe": "baidu/ERNIE-4.5-21B-A3B-PT",
    "hunyuan_v1_moe": "tencent/Hunyuan-A13B-Instruct",
}


def spec_of(replayer: RouterReplay, model: str = "") -> RouteSpec:
    top_k = int(replayer.routers[0].top_k)
    return RouteSpec(replayer.num_layers, replayer.experts[0], top_k, model=model)


@pytest.mark.parametrize("name", sorted(GATES))
def test_a_released_models_gate_is_its_familys(name: str) -> None:
    model = tiny(name)
    RouterReplay(model, spec_of(RouterReplay(model), GATES[name]))


@pytest.mark.parametrize(
    ("name", "released", "message"),
    [
        ("qwen3_moe", "deepseek-ai/DeepSeek-V3", "whose gate is sigmoid, renormalised, a bias"),
        ("qwen2_moe", "Qwen/Qwen3-30B-A3B", "renormalised; its Qwen2MoeTopKRouter applies "),
        ("lfm2_moe_nobias", "LiquidAI/LFM2-8B-A1B", "applies sigmoid, renormalised$"),
    ],
)
def test_another_gate_than_the_specs_model_is_refused(
    name: str, released: str, message: str
) -> None:
    model = tiny(name)
    with pytest.raises(ValueError, match=message):
        RouterReplay(model, spec_of(RouterReplay(model), released))


def test_the_spec_is_checked_at_attach() -> None:
    model = tiny("qwen3_moe")  # 2 MoE layers, 4 experts, top-2
    RouterReplay(model, RouteSpec(2, 4, 2))
    for spec, message in (
        (RouteSpec(3, 4, 2), r"2 MoE layers \(routes: 3\)"),
        (RouteSpec(2, 8, 2), r"4 experts \(routes: 8\)"),
        (RouteSpec(2, 4, 3), r"top-k 2 \(routes: 3\)"),
    ):
        with pytest.raises(ValueError, match=message):
            RouterReplay(model, spec)
    with pytest.warns(GateNotChecked, match="'acme/moe-7b' is not one whose gate replay knows"):
        RouterReplay(model, RouteSpec(2, 4, 2, model="acme/moe-7b"))
