"""A rollout worker: responses with their routes, as SGLang returns them, sent to r3store.

    make serve                          # in another terminal: the embedded store
    python examples/rollout_worker.py   # then: python examples/trainer.py

A real worker gets its responses from SGLang (`return_routed_experts=True`); a
synthetic engine of the same output format stands in here. `R3STORE_URL` names the
server (default `http://127.0.0.1:8330`) and `R3STORE_KEY` a key with the `writer` role
once the namespace exists (`r3store namespaces create quickstart --layers 4 --experts 16
--top-k 2`), or the `admin` role to have the worker create it: none is needed while the
server runs on the embedded store on a loopback address with no keys (authentication is
off there). The worker only checks that the namespace has its route spec, so an
operator may change its settings (`r3store settings quickstart --keep-versions 4`)
between runs; the trainer, not the worker, moves the policy version on.
"""

from __future__ import annotations

import base64
import os
from typing import Any

import numpy as np

from r3store.spec import RouteSpec
from r3store_client import Client, RolloutWriter
from r3store_client.convert import from_sglang

URL = os.environ.get("R3STORE_URL", "http://127.0.0.1:8330")
KEY = os.environ.get("R3STORE_KEY")  # None: authentication is off on the embedded server
NAMESPACE = "quickstart"
LAYERS, EXPERTS, TOP_K = 4, 16, 2  # the model's MoE shape (the trainer's tiny model)
PROMPT, OUTPUT, GROUPS, SAMPLES = 48, 80, 4, 4  # a GRPO step: 4 prompts x 4 samples
POLICY_VERSION = 1


def sglang_response(rng: np.random.Generator, rid: str) -> dict[str, Any]:
    """What SGLang answers with `return_routed_experts=True`: `meta_info.routed_experts`
    is base64 of int32 `[tokens - 1, layers, top_k]` (the last token never ran)."""
    prompt = rng.integers(0, 256, PROMPT).tolist()
    output = rng.integers(0, 256, OUTPUT).tolist()
    scores = rng.random((PROMPT + OUTPUT - 1, LAYERS, EXPERTS))
    routes = np.argsort(-scores, axis=-1)[..., :TOP_K].astype("<i4")  # the router's top-k
    meta = {"id": rid, "routed_experts": base64.b64encode(routes.tobytes()).decode()}
    return {"prompt_ids": prompt, "output_ids": output, "meta_info": meta}


def main() -> None:
    rng = np.random.default_rng(0)
    with Client(URL, api_key=KEY) as client:
        client.ensure_namespace(NAMESPACE, RouteSpec(LAYERS, EXPERTS, TOP_K))  # this spec
        with RolloutWriter(client, NAMESPACE) as writer:  # batches uploads in the background
            for group in range(GROUPS):
                for sample in range(SAMPLES):
                    rid = f"step{POLICY_VERSION}/prompt{group}/sample{sample}"
                    out = sglang_response(rng, rid)
                    tokens = out["prompt_ids"] + out["output_ids"]
                    writer.write(
                        from_sglang(
                            rid,
                            out["meta_info"],
                            len(tokens),
                            LAYERS,
                            TOP_K,
                            group_id=f"step{POLICY_VERSION}/prompt{group}",
                            prompt_len=PROMPT,
                            policy_version=POLICY_VERSION,
                            token_ids=np.asarray(tokens, dtype=np.int32),
                        )
                    )
        report = writer.report
        print(f"sent {report.sent}, refused {len(report.failed)}, unsent {len(report.unsent)}")
        print(f"{client.namespace(NAMESPACE).trajectories} trajectories in {NAMESPACE!r}")


if __name__ == "__main__":
    main()
