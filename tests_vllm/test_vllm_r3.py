"""vLLM's sampled routes, through r3store, replayed in the HF model and in a
Megatron-Core GPT built from the same weights (`examples/vllm_r3.py`, small).

vLLM (fp32 and bf16) samples with the whole vocabulary's logprobs while its own
capturer records the routes; they are put in r3store, resolved from the puts' refs, and
replayed by each trainer (HF and Megatron, fp32 and bf16): every MoE layer of every
trainer runs exactly vLLM's experts, and the KL from vLLM's distributions is lower with
replay than without wherever the trainer's own routers disagree with vLLM's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from vllm_r3 import HEADER, megatron_against_hf, run


def test_vllm_routes_replayed_in_hf_and_megatron(tmp_path: Path, figures: list[str]) -> None:
    out = run(tmp_path, count=3, new_tokens=8)
    assert {f.trainer for f in out} == {"HF fp32", "HF bf16", "Megatron fp32", "Megatron bf16"}
    figures.append(HEADER)
    figures.extend(f.line() for f in out)
    figures.extend(megatron_against_hf(out))
    for f in out:
        assert f.replayed_exactly, f.line()  # every MoE layer ran vLLM's experts
        live, replay = float(np.mean(f.kl_live)), float(np.mean(f.kl_replay))
        if f.agreement < 1:
            assert replay < live, f.line()
        else:  # nothing to replay differently: the same distributions
            assert replay == pytest.approx(live, rel=1e-3, abs=1e-9), f.line()
    assert any(f.agreement < 1 for f in out)  # bf16 against fp32 routes somewhere else
    by = {(f.engine, f.trainer): f for f in out}
    for engine in ("fp32", "bf16"):  # the same weights and routes: the same model
        hf, mg = by[engine, "HF fp32"].logprobs, by[engine, "Megatron fp32"].logprobs
        for a, b in zip(hf, mg, strict=True):
            assert float((a.exp() * (a - b)).sum(-1).max()) < 1e-6
