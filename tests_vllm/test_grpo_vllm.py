"""`examples/grpo_r3.py` with the rollout on vLLM, shortened: the same invariants as
with the emulated engine (`tests/test_grpo_example.py`), the routes vLLM's capturer
recorded, stored as sets, replayed exactly, and the trainer's weights loaded into the
running engine after each step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from test_grpo_example import TINY, check_loop


def test_grpo_loop_on_vllm_replays_vllms_experts(tmp_path: Path) -> None:
    cfg = dataclasses.replace(TINY, engine="vllm", engine_dtype="bf16")
    results = check_loop(cfg, tmp_path)
    for s in results["R3"].steps:
        assert s.kl < 1e-2  # the engine serves the trainer's weights of each step
