"""A trainer rank: fetches the routes of its micro-batches and replays them in an MoE.

    make serve                          # in another terminal: the embedded store
    python examples/rollout_worker.py   # stores a GRPO step's routes
    python examples/trainer.py          # needs: pip install -e '.[torch]' transformers

The model is a tiny Qwen3-MoE built from a config (no download) with the namespace's
shape. Each data-parallel rank takes its share of the step's trajectories, fetches only
their routes (the next micro-batch while the current one computes), and runs forward and
backward with every router forced to the engine's experts; after the step, rank 0 sets
the namespace's policy version to the new weights' (2). `R3STORE_URL` and `R3STORE_KEY`
(a `trainer` key) as for the worker; `RANK` and `WORLD_SIZE` as a launcher sets them
(default: one rank).
"""

from __future__ import annotations

import os

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from r3store_client import Client
from r3store_client.reader import TrainerReader
from r3store_client.replay import RouterReplay
from r3store_client.tensors import micro_batches, rank_slice

URL = os.environ.get("R3STORE_URL", "http://127.0.0.1:8330")
KEY = os.environ.get("R3STORE_KEY")  # None: authentication is off on the embedded server
NAMESPACE = "quickstart"
RANK, WORLD_SIZE = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
POLICY_VERSION = 1  # the policy the worker's rollouts came from


def tiny_moe(layers: int, experts: int, top_k: int) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=experts,
        num_experts_per_tok=top_k,
        max_position_embeddings=512,
    )
    return Qwen3MoeForCausalLM(config)


def main() -> None:
    torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
    with Client(URL, api_key=KEY) as client:
        spec = client.namespace(NAMESPACE).spec
        model = tiny_moe(spec.num_layers, spec.num_experts, spec.top_k)
        # The step's rollouts: an RL framework hands them to the trainer; here their token
        # ids are read back from r3store, where the worker stored them beside the routes
        # (only the token streams are decoded; the routes come below, per micro-batch).
        step = [f"step{POLICY_VERSION}/prompt{g}/sample{s}" for g in range(4) for s in range(4)]
        tokens = {
            tid: torch.from_numpy(ids).long()
            for tid, ids in client.token_ids(NAMESPACE, step).items()
            if ids is not None
        }
        mine = rank_slice(sorted(tokens), RANK, WORLD_SIZE)  # only this rank's routes
        reader = TrainerReader(client, NAMESPACE)
        replayer = RouterReplay(model)  # the HF MoE routers it knows, each with its own gate
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = micro_batches(mine, 4)
        for ids, routes in zip(batches, reader.iterate(batches), strict=True):
            inputs = torch.stack([tokens[i] for i in ids])  # one length here: no padding
            with replayer.replay(routes):  # routes.to("cuda") on a GPU
                loss = model(input_ids=inputs, labels=inputs).loss
            loss.backward()
            print(f"rank {RANK}: {len(ids)} trajectories replayed, loss {loss.item():.3f}")
        optimizer.step()
        print(f"rank {RANK}: replayed {len(mine)} trajectories of {NAMESPACE!r}")
        if RANK == 0:  # the new weights: rollouts from now on are of the next version
            client.set_policy_version(NAMESPACE, POLICY_VERSION + 1)


if __name__ == "__main__":
    main()
