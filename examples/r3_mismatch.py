"""Routing mismatch between an "inference engine" and a "trainer", with and without R3.

A tiny Qwen3-MoE (HF transformers, built from a config, no downloads) is trained for a
few hundred steps as a byte-level language model on the standard library's top-level
Python modules, so its outputs depend on which experts run. A bf16 copy plays the
inference engine: on text it was not trained on (the `email` and `json` packages) it
records its routes, and a rollout worker sends them through a real r3store server. The
fp32 model plays the trainer: it fetches the routes and runs once with its own routers
and once replaying the engine's.

    python examples/r3_mismatch.py [--steps 200] [--seed 0]   # about 2.5 minutes on 2 cores

Prints, per layer, how often the trainer's own routers agree with the engine's and how
often the experts it actually ran under replay are the engine's (always: 1.000); then
the mean KL between the engine's and the trainer's token distributions, and the
fraction of tokens whose probability ratio (trainer over engine, for the token that
follows) lies outside [1/2, 2], with and without replay.
"""

from __future__ import annotations

import argparse
import copy
import os
import sysconfig
import tempfile
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from r3store.spec import RouteSpec
from r3store.testing.service import start_server, stop_server
from r3store_client import Client, RolloutWriter
from r3store_client.convert import from_topk
from r3store_client.reader import TrainerReader
from r3store_client.replay import RouterReplay

LAYERS, EXPERTS, TOP_K, HIDDEN = 4, 64, 8, 128


def corpus(pattern: str, limit: int = 4 << 20) -> np.ndarray:
    """Bytes of the standard library's Python sources matching `pattern`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob(pattern)):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def model(
    seed: int, layers: int = LAYERS, experts: int = EXPERTS, top_k: int = TOP_K
) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
        max_position_embeddings=512,
    )
    return Qwen3MoeForCausalLM(config)


def train(net: Qwen3MoeForCausalLM, data: np.ndarray, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    net.train()
    for step in range(steps):
        starts = rng.integers(0, len(data) - 129, 16)
        batch = torch.from_numpy(np.stack([data[s : s + 129] for s in starts]).astype(np.int64))
        loss = net(batch[:, :-1], labels=batch[:, :-1]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}  loss {loss.item():.3f}", flush=True)
    net.eval()


def compare(
    engine_logp: torch.Tensor, trainer_logp: torch.Tensor, targets: torch.Tensor
) -> tuple[float, float]:
    """Mean KL(engine || trainer) per token, and the share of tokens whose next-token
    probability ratio trainer/engine lies outside [1/2, 2]."""
    kl = (engine_logp.exp() * (engine_logp - trainer_logp)).sum(-1).mean().item()
    ratio = (
        trainer_logp.gather(-1, targets[..., None]) - engine_logp.gather(-1, targets[..., None])
    ).exp()
    extreme = ((ratio > 2) | (ratio < 0.5)).float().mean().item()
    return kl, extreme


def agreement(chosen: torch.Tensor, engine: torch.Tensor) -> list[float]:
    """Per layer, the share of token-layers whose expert sets are the engine's;
    `chosen` is `[B * T, L, K]` (as routers see tokens) or `[B, T, L, K]`."""
    a = chosen.reshape(-1, LAYERS, TOP_K).long().sort(dim=-1).values
    b = engine.reshape(-1, LAYERS, TOP_K).long().sort(dim=-1).values
    return (a == b).all(dim=-1).float().mean(dim=0).tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    # one thread per core, no more: oversubscribing a busy machine makes it far slower
    torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
    data = corpus("*.py")
    unseen = np.concatenate([corpus("email/*.py"), corpus("json/*.py")])
    trainer = model(args.seed)
    print(
        f"training a tiny Qwen3-MoE ({LAYERS} layers, {EXPERTS} experts, top-{TOP_K}) "
        f"for {args.steps} steps on {len(data) >> 10} KiB of Python source"
    )
    train(trainer, data, args.steps, args.seed)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)

    rng = np.random.default_rng(args.seed + 1)
    starts = rng.integers(0, len(unseen) - args.length - 1, args.samples)
    seqs = torch.from_numpy(
        np.stack([unseen[s : s + args.length + 1] for s in starts]).astype(np.int64)
    )
    inputs, targets = seqs[:, :-1], seqs[:, 1:]

    with tempfile.TemporaryDirectory(prefix="r3-mismatch-") as tmp:
        server, url = start_server(Path(tmp))  # embedded store, loopback: no keys
        try:
            client = Client(url)
            client.create_namespace("mismatch", RouteSpec(LAYERS, EXPERTS, TOP_K, ordered=True))
            # the inference engine: bf16, records its routes; a rollout worker sends them
            engine_replay = RouterReplay(engine)
            with torch.no_grad(), engine_replay.record() as recorded:
                engine_logp = torch.log_softmax(engine(inputs).logits.float(), -1)
            ids = [f"sample-{i}" for i in range(args.samples)]
            with RolloutWriter(client, "mismatch") as writer:
                for i, tid in enumerate(ids):
                    tokens = inputs[i].numpy().astype("int32")  # replay checks them
                    writer.write(from_topk(tid, recorded.ids[i], args.length, token_ids=tokens))
            # the trainer: fp32, fetches the routes, runs live and with replay
            routes = TrainerReader(client, "mismatch").fetch(ids)
            replayer = RouterReplay(trainer)
            with torch.no_grad(), replayer.record() as live:
                live_logp = torch.log_softmax(trainer(inputs).logits, -1)
            live_agreement = agreement(live.ids, recorded.ids)
            used: list[torch.Tensor] = []  # the experts each router hands its MoE block
            hooks = [
                r.register_forward_hook(lambda _m, _i, out: used.append(out[2].clone()))
                for r in replayer.routers
            ]
            with torch.no_grad(), replayer.replay(routes):
                replay_logp = torch.log_softmax(trainer(inputs).logits, -1)
            for hook in hooks:
                hook.remove()
            client.close()
        finally:
            stop_server(server)

    kl_live, extreme_live = compare(engine_logp, live_logp, targets)
    kl_replay, extreme_replay = compare(engine_logp, replay_logp, targets)
    used_agreement = agreement(torch.stack(used, dim=1), recorded.ids)
    print(f"\nroute agreement with the engine's top-{TOP_K} sets, per layer:")
    print(f"  {'':10}{'own routers':>14}{'experts run under replay':>28}")
    for layer in range(LAYERS):
        print(f"  layer {layer}: {live_agreement[layer]:14.4f}{used_agreement[layer]:28.3f}")
    print(f"\n{'':24}{'mean KL':>12}{'ratio outside [1/2, 2]':>26}")
    print(f"{'without replay':24}{kl_live:12.3e}{extreme_live:26.4%}")
    print(f"{'with R3 replay':24}{kl_replay:12.3e}{extreme_replay:26.4%}")


if __name__ == "__main__":
    main()
