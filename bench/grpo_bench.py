"""R3 in a real GRPO loop through the service (`examples/grpo_r3.py`): both arms, replay
and none, from the same pretrained weights and seeds, against a server of its own.

For each engine precision: the mean training-inference KL on the sampled tokens (k3)
and its largest step, and the mean share of extreme tokens (trainer/engine probability
ratio above 2 or below 1/2), with replay beside without; the mean reward of the final
20 steps of each arm; the least engine/trainer routing agreement the server computed
under replay. The curves are drawn in `bench/results/grpo_r3.png` (the first
precision's; the others in `grpo_r3_<precision>.png`), their per-step rows beside them
(`.csv`). `bf16` is the engine the issue names (emulated on the CPU, see the example);
`fp8` an FP8 rollout engine, a wider numeric gap of the kind deployed.

Full: 100 steps per arm and precision (bf16 and fp8); quick: 10 steps, bf16 only, the
plot labelled as such and written to the temporary directory (`r3store-grpo/`). The
pretrained weights are kept in `bench/.corpus/grpo/`.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.figures import Figure
from r3store.testing.service import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
CACHE = Path(__file__).parent / ".corpus" / "grpo"


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo_r3

    return grpo_r3


def run(
    quick: bool = False,
    precisions: tuple[str, ...] | None = None,
    steps: int | None = None,
    plot_dir: Path | None = None,
) -> tuple[list[Figure], dict[str, object]]:
    g = _example()
    # a quick run's curves go to the temporary directory, not over the full run's
    plot_dir = plot_dir or (Path(tempfile.gettempdir()) / "r3store-grpo" if quick else RESULTS)
    steps = steps or (10 if quick else 100)
    precisions = precisions or (("bf16",) if quick else ("bf16", "fp8"))
    figures: list[Figure] = []
    details: dict[str, object] = {}
    for i, precision in enumerate(precisions):
        cfg = g.Config(steps=steps, engine_dtype=precision)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
            server, url = start_server(Path(tmp))
            try:
                results = g.run_arms(cfg, url, cache=CACHE)
            finally:
                stop_server(server)
        seconds = time.perf_counter() - started
        tail = min(20, steps)
        s = g.summary(results, tail=tail)
        label = f"grpo {precision} engine, {steps} steps/arm" + (" (quick)" if quick else "")
        name = "grpo_r3.png" if i == 0 else f"grpo_r3_{precision}.png"
        title = f"GRPO on a tiny Qwen3-MoE through r3store: {precision} engine, fp32 trainer"
        g.plot(results, plot_dir / name, title + (" (quick run)" if quick else ""))
        g.write_csv(results, (plot_dir / name).with_suffix(".csv"))
        figures += [
            Figure(
                f"{label}: KL(k3) R3",
                s["r3_kl"],
                "nats/token",
                s["live_kl"],
                "no replay",
                "<= 0.5x",
            ),
            Figure(
                f"{label}: max-step KL(k3) R3",
                s["r3_kl_max"],
                "nats/token",
                s["live_kl_max"],
                "no replay",
            ),
            Figure(
                f"{label}: extreme tokens R3",
                s["r3_extreme"],
                "share",
                s["live_extreme"],
                "no replay",
                "<= 0.2x",
            ),
            Figure(
                f"{label}: final-{tail} reward R3",
                s["r3_reward_final"],
                "vowel share",
                s["live_reward_final"],
                "no replay",
                ">= 1x",
            ),
            Figure(
                f"{label}: min agreement R3", s["r3_agreement_min"], "share", None, None, "1.000"
            ),
            Figure(f"{label}: mean agreement no replay", s["live_agreement_mean"], "share"),
            Figure(
                f"{label}: clip fraction R3", s["r3_clip"], "share", s["live_clip"], "no replay"
            ),
            Figure(f"{label}: both arms", seconds, "s"),
        ]
        details[f"grpo_{precision}"] = {
            "config": asdict(cfg),
            "summary": s,
            "plot": str((plot_dir / name).relative_to(ROOT)) if plot_dir == RESULTS else name,
            "steps": {arm: [asdict(x) for x in r.steps] for arm, r in results.items()},
        }
    return figures, details
