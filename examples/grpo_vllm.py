"""The GRPO example's engine on vLLM (`grpo_r3.py --engine vllm`), in vLLM's environment.

The policy is saved once and served by vLLM's `LLM` on the CPU (the V1 runner in this
process, `tests_vllm/vllm_engine.py`), in `bf16` (vLLM's own CPU kernels: the numeric
gap R3 exists for, from a different inference stack) or `fp32`. A rollout samples at
temperature 1 with a seed per request; vLLM's log-probability of each sampled token is
kept, and vLLM's own `RoutedExpertsCapturer` records the experts its routers chose, as
vLLM's `routed_experts` (`[num_tokens - 1, layers, K]`, its slots in no promised order).
After each step the trainer's weights go into the running engine in place
(`vllm_engine.load_weights`, vLLM's `reload_weights`), as RL stacks update their engines.
Prefix caching is off: a group's prompt must run once per request for its routes to be
captured per request.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests_vllm") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests_vllm"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm_engine import capturing, checkpoint, engine, load_weights  # noqa: E402

from r3store.records import TrajectoryWrite  # noqa: E402
from r3store_client.convert import from_vllm  # noqa: E402

DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


class VllmEngine:
    """vLLM serving the policy; the experts its routers chose, as it delivers them."""

    ordered = False  # vLLM promises no slot order: its routes are stored as sets

    def __init__(self, policy: Any, precision: str, max_seqs: int = 32) -> None:
        if precision not in DTYPES:
            raise SystemExit(f"the vLLM engine runs {' or '.join(DTYPES)}, not {precision!r}")
        self._dir = tempfile.TemporaryDirectory(prefix="grpo-vllm-")
        self._steps = 0
        path = Path(self._dir.name) / "policy"
        policy.save_pretrained(path)
        self.dtype = getattr(torch, DTYPES[precision])
        self.llm = engine(path, DTYPES[precision], max_seqs, enable_prefix_caching=False)

    def load(self, net: torch.nn.Module) -> None:
        """`net`'s weights into the running engine."""
        self._steps += 1
        path = Path(self._dir.name) / f"step{self._steps}"
        weights = checkpoint(net, path)  # sent in the engine's dtype, as RL stacks send them
        load_weights(self.llm, {name: w.to(self.dtype) for name, w in weights.items()})
        for shard in path.iterdir():
            shard.unlink()
        path.rmdir()

    def generate(
        self, prompts: torch.Tensor, length: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Sequences `[B, P + length]`, vLLM's logprob of each sampled token
        `[B, length]`, and vLLM's routes `[B, P + length - 1, L, K]`; request `i`
        sampled with the seed `seed * 1000 + i`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                temperature=1.0,
                seed=seed * 1000 + i,
                max_tokens=length,
                ignore_eos=True,
                logprobs=0,
            )
            for i in range(prompts.shape[0])
        ]
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts.tolist()]
        with capturing(self.llm) as capture:
            outputs = self.llm.generate(batch, params, use_tqdm=False)
        seqs, logps, routes = [], [], []
        for out in outputs:
            done = out.outputs[0]
            tokens = list(out.prompt_token_ids) + list(done.token_ids)
            seqs.append(tokens)
            logps.append([p[t].logprob for p, t in zip(done.logprobs, done.token_ids, strict=True)])
            routes.append(capture.routes(out.request_id, len(tokens)))
        return torch.tensor(seqs), torch.tensor(logps), np.stack(routes)

    @staticmethod
    def write(trajectory_id: str, routes: np.ndarray, **meta: Any) -> TrajectoryWrite:
        """The routes of the tokens fed to the model, as vLLM delivered them."""
        return from_vllm(trajectory_id, routes, routes.shape[0], **meta)

    def close(self) -> None:
        self._dir.cleanup()
