"""Routing mismatch between an "inference engine" and a "trainer", with and without R3.

A tiny Qwen3-MoE (HF transformers, built from a config, no downloads) is trained for a
few hundred steps as a byte-level language model on Python source from the standard
library, so its outputs depend on which experts run. A bf16 copy plays the inference
engine: it records its routes, and a rollout worker sends them through a real r3store
server. The fp32 model plays the trainer: it fetches the routes and runs once with its
own routers and once replaying the engine's.

    python examples/r3_mismatch.py [--steps 300] [--seed 0]

Prints per-layer route agreement, the mean KL between the engine's and the trainer's
token distributions, and the fraction of tokens whose probability ratio (trainer over
engine, for the token that follows) lies outside [1/2, 2], with and without replay.
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


def corpus(limit: int = 4 << 20) -> np.ndarray:
    """Bytes of Python source from the standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


def model(seed: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    data = corpus()
    trainer = model(args.seed)
    print(
        f"training a tiny Qwen3-MoE ({LAYERS} layers, {EXPERTS} experts, top-{TOP_K}) "
        f"for {args.steps} steps on {len(data) >> 10} KiB of Python source"
    )
    train(trainer, data, args.steps, args.seed)
    engine = copy.deepcopy(trainer).to(torch.bfloat16)

    rng = np.random.default_rng(args.seed + 1)
    starts = rng.integers(0, len(data) - args.length - 1, args.samples)
    seqs = torch.from_numpy(
        np.stack([data[s : s + args.length + 1] for s in starts]).astype(np.int64)
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
                    writer.write(from_topk(tid, recorded.ids[i], args.length))
            # the trainer: fp32, fetches the routes, runs live and with replay
            routes = TrainerReader(client, "mismatch").fetch(ids)
            replayer = RouterReplay(trainer)
            with torch.no_grad():
                live_logp = torch.log_softmax(trainer(inputs).logits, -1)
                with replayer.replay(routes):
                    replay_logp = torch.log_softmax(trainer(inputs).logits, -1)
            client.close()
        finally:
            stop_server(server)

    kl_live, extreme_live = compare(engine_logp, live_logp, targets)
    kl_replay, extreme_replay = compare(engine_logp, replay_logp, targets)
    print("\nroute agreement per layer (trainer's own top-8 set == engine's):")
    for layer, agree in enumerate(replayer.agreement):
        print(f"  layer {layer}: {agree:.4f}")
    print(f"\n{'':24}{'mean KL':>12}{'ratio outside [1/2, 2]':>26}")
    print(f"{'without replay':24}{kl_live:12.3e}{extreme_live:26.4%}")
    print(f"{'with R3 replay':24}{kl_replay:12.3e}{extreme_replay:26.4%}")


if __name__ == "__main__":
    main()
