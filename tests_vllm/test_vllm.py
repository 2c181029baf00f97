"""Routes from vLLM itself, through r3store, into the HF trainer's replay.

A tiny MoE of each family (built here, fp32, seeded random weights) is served by vLLM
on the CPU; vLLM's own `RoutedExpertsCapturer` records the experts its routers chose
for every token (`vllm_engine`). The routes go to a real r3store server as vLLM's
`routed_experts` would (`from_vllm`: the MoE layers only, with the token ids), come back
as the same expert sets, agree with the HF model's own routers on the same tokens, and
replay in the HF model so that its MoE blocks run vLLM's experts. vLLM promises no slot
order (its CPU router takes `torch.topk(..., sorted=False)`): a namespace that keeps the
order refuses its routes, and they are stored as sets.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from vllm.utils.serial_utils import numpy2base64
from vllm_engine import (
    DEEPSEEK_V3,
    QWEN3_MOE,
    VOCAB,
    Tiny,
    build,
    capturing,
    checkpoint,
    engine,
    generate,
    load_weights,
    sample,
)

from r3store.errors import InvalidRoutes
from r3store.spec import RouteSpec
from r3store_client import Client
from r3store_client.convert import from_vllm
from r3store_client.hf_routers import FAMILIES
from r3store_client.reader import TrainerReader
from r3store_client.replay import RouterReplay, same_sets
from r3store_client.tensors import CompactRoutes

PROMPT_LENGTHS = (7, 12, 5)
NEW_TOKENS = 8
_names = itertools.count()


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, n)] for n in PROMPT_LENGTHS]


def served(tiny: Tiny, path: Path) -> tuple[Any, list[tuple[str, list[int], np.ndarray]]]:
    """The HF model, and per request `(id, tokens, vLLM's routes [T - 1, layers, K])`."""
    hf = build(tiny, path)
    llm = engine(path)
    with capturing(llm) as capture:
        outputs = generate(llm, prompts(), NEW_TOKENS)
    assert capture.steps >= NEW_TOKENS  # a prefill, then a step per decoded token
    return hf, [(rid, tokens, capture.routes(rid, len(tokens))) for rid, tokens in outputs]


def experts_run(hf: Any, replayer: RouterReplay, routes: CompactRoutes, batch: Any) -> Any:
    """`[T, L, K]`: the experts each router handed its MoE block, replaying `routes`."""
    used: list[torch.Tensor] = []
    hooks = [
        r.register_forward_hook(lambda _m, _i, out: used.append(out[2].clone()))
        for r in replayer.routers
    ]
    try:
        with torch.no_grad(), replayer.replay(routes):
            hf(input_ids=batch)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([u.reshape(batch.shape[1], -1) for u in used], dim=1)


@pytest.mark.parametrize("tiny", [QWEN3_MOE, DEEPSEEK_V3], ids=lambda t: t.name)
def test_vllm_routes_through_r3store_into_hf_replay(
    tiny: Tiny, tmp_path: Path, client: Client, figures: list[str]
) -> None:
    hf, requests = served(tiny, tmp_path)
    dense = [i for i in range(tiny.num_layers) if i not in tiny.moe_layers]
    for _rid, tokens, routes in requests:
        assert routes.shape == (len(tokens) - 1, tiny.num_layers, tiny.top_k)
        assert routes.dtype == np.uint8  # vLLM's dtype for up to 256 experts
        assert not routes[:, dense].any()  # dense layers: zeros, as vLLM sends them
        moe = routes[:, tiny.moe_layers].astype(np.int64)
        assert moe.max() < tiny.num_experts
        assert all(len(set(row)) == tiny.top_k for row in moe.reshape(-1, tiny.top_k))

    # into r3store as vLLM's `routed_experts`, and back as a trainer reads them
    namespace = f"vllm{next(_names)}"
    spec = RouteSpec(len(tiny.moe_layers), tiny.num_experts, tiny.top_k)
    client.create_namespace(namespace, spec)
    writes = [
        from_vllm(
            f"{namespace}-{rid}",
            routes,
            len(tokens),
            moe_layers=tiny.moe_layers,
            token_ids=np.asarray(tokens, dtype=np.int32),
        )
        for rid, tokens, routes in requests
    ]
    # the OpenAI server's answer: base64 of an .npy file, made by vLLM's own serializer
    # (uint16 is what vLLM sends past 256 experts): the same writes
    for write, (_rid, tokens, routes) in zip(writes, requests, strict=True):
        for sent in (routes, routes.astype(np.uint16)):
            answered = from_vllm(
                write.trajectory_id, numpy2base64(sent), len(tokens), moe_layers=tiny.moe_layers
            )
            assert np.array_equal(np.asarray(answered.topk), np.asarray(write.topk))
    # vLLM promises no slot order: a namespace that keeps the order refuses its routes,
    # naming the trajectory and the engine
    client.create_namespace(f"{namespace}-ordered", replace(spec, ordered=True))
    with pytest.raises(InvalidRoutes, match="vLLM promises no order") as caught:
        client.put(f"{namespace}-ordered", writes)
    assert str(caught.value).startswith(f"{writes[0].trajectory_id}: ")
    client.put(namespace, writes)
    reader = TrainerReader(client, namespace, compact=False)
    agree = total = in_rank = 0
    replayer = RouterReplay(hf, spec)
    ranked = FAMILIES[type(replayer.routers[0]).__name__].ranked  # HF's order: rank order
    for write, (_rid, tokens, routes) in zip(writes, requests, strict=True):
        back = reader.fetch([write.trajectory_id])
        n = len(tokens)
        engine_ids = torch.from_numpy(routes[:, tiny.moe_layers].astype(np.int64))
        engine_sets = torch.sort(engine_ids, dim=-1).values
        assert torch.equal(back.ids[0, : n - 1].long(), engine_sets)  # vLLM's sets, sorted
        assert back.valid[0, : n - 1].all()
        assert not back.valid[0, n - 1].any()  # the last sampled token: not recorded
        assert back.tokens is not None
        assert back.tokens[0, :n].tolist() == tokens

        # the HF model's own routers on the same tokens (fp32 on both sides)
        batch = torch.tensor([tokens])
        with torch.no_grad(), replayer.record() as live:
            hf(input_ids=batch)
        own = live.ids[0, : n - 1]  # [T - 1, L, K]
        same = same_sets(own.reshape(-1, tiny.top_k), engine_ids.reshape(-1, tiny.top_k))
        agree += int(same.sum())
        total += same.numel()
        rows = own.reshape(-1, tiny.top_k).long() == engine_ids.reshape(-1, tiny.top_k)
        in_rank += int(rows.all(dim=-1).sum())  # vLLM's slots in HF's order

        # replayed: the HF model's MoE blocks run vLLM's experts
        compact = TrainerReader(client, namespace).fetch([write.trajectory_id])
        assert isinstance(compact, CompactRoutes)
        ran = experts_run(hf, replayer, compact, batch)[: n - 1]
        assert same_sets(ran.reshape(-1, tiny.top_k), engine_ids.reshape(-1, tiny.top_k)).all()

    figures.append(
        f"{tiny.name}: HF's own routers (fp32) pick vLLM's (fp32) experts in "
        f"{agree}/{total} token-layers ({agree / total:.2%}); replayed: all"
    )
    assert agree / total >= 0.95
    if ranked:  # the CPU router's unsorted top-k: its slots are not the rank order
        figures.append(
            f"{tiny.name}: vLLM's slots in rank order (HF's, sorted) in {in_rank}/{total} "
            f"token-layers ({in_rank / total:.2%})"
        )
        assert in_rank < agree


def max_logprob_error(llm: Any, hf: Any) -> float:
    """The largest difference between vLLM's logprobs (the whole vocabulary, at every
    sampled token) and the HF model's on the same tokens."""
    worst = 0.0
    for done in sample(llm, prompts(1), NEW_TOKENS):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([done.tokens])).logits[0].float()
        mine = torch.log_softmax(logits, -1)[done.prompt_len - 1 : -1]
        worst = max(worst, float((mine - torch.from_numpy(done.logprobs)).abs().max()))
    return worst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_loaded_into_a_running_engine_are_the_ones_it_runs(
    dtype: str, tmp_path: Path
) -> None:
    """An RL loop's weight update: the trainer's new weights into the running engine
    (`load_weights`, in the engine's dtype). It then samples exactly what a fresh
    engine built from those weights samples, with the same logprobs; in fp32 they are
    the HF model's."""
    hf = build(QWEN3_MOE, tmp_path / "model", init_std=0.3)
    llm = engine(tmp_path / "model", dtype, max_logprobs=VOCAB)
    if dtype == "float32":
        assert max_logprob_error(llm, hf) < 1e-4
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    before = sample(llm, prompts(1), NEW_TOKENS)
    weights = checkpoint(hf, tmp_path / "step1")  # with its config: a model to serve
    load_weights(llm, {name: w.to(getattr(torch, dtype)) for name, w in weights.items()})
    reloaded = sample(llm, prompts(1), NEW_TOKENS)
    if dtype == "float32":
        assert max_logprob_error(llm, hf) < 1e-4
    del llm
    gc.collect()
    fresh = sample(engine(tmp_path / "step1", dtype, max_logprobs=VOCAB), prompts(1), NEW_TOKENS)
    for old, new, want in zip(before, reloaded, fresh, strict=True):
        assert new.tokens == want.tokens
        assert np.array_equal(new.logprobs, want.logprobs)
        assert np.abs(old.logprobs[0] - want.logprobs[0]).max() > 1.0  # the weights moved
