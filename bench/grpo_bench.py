"""R3 in a real GRPO loop through the service (`examples/grpo_r3.py`): both arms, replay
and none, from the same pretrained weights and seeds, against a server of its own.

Per engine: the mean training-inference KL on the sampled tokens (k3) and its largest
step, and the mean share of extreme tokens (trainer/engine probability ratio above 2 or
below 1/2), with replay beside without; the mean reward of the final 20 steps of each
arm; the least engine/trainer routing agreement the server computed under replay. The
engines: vLLM in bf16 (`vllm bf16`: a real inference stack, its own CPU kernels; run in
`.venv-vllm` as a process of its own, `python -m bench.grpo_bench --json FILE`), then
the trainer's own model with bf16 emulated (`bf16`) and as an FP8 rollout engine
(`fp8`), see the example. The curves are drawn in `bench/results/grpo_r3.png` (the
first engine's; the others in `grpo_r3_<engine>.png`), their per-step rows beside them
(`.csv`).

Full: 100 steps per arm and engine; quick: 10 steps, vLLM and emulated bf16 only, the
plots labelled as such and written to the temporary directory (`r3store-grpo/`). The
pretrained weights are kept in `bench/.corpus/grpo/`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import venvs
from bench.figures import Figure
from r3store.testing.service import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
CACHE = Path(__file__).parent / ".corpus" / "grpo"
VLLM = "vllm bf16"


def _example() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    import grpo_r3

    return grpo_r3


def _config(engine: str, steps: int) -> Any:
    g = _example()
    if engine == VLLM:
        return g.Config(steps=steps, engine="vllm", engine_dtype="bf16")
    return g.Config(steps=steps, engine_dtype=engine)


def _arms(cfg: Any) -> tuple[dict[str, Any], float]:
    """Both arms of `cfg` against a server of their own, and the seconds they took."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo-bench-") as tmp:
        server, url = start_server(Path(tmp))
        try:
            results = _example().run_arms(cfg, url, cache=CACHE)
        finally:
            stop_server(server)
    return results, time.perf_counter() - started


def _vllm_arms(steps: int, quick: bool) -> tuple[dict[str, Any], float]:
    """The vLLM engine's arms, run in `.venv-vllm`, rebuilt here."""
    g = _example()
    _, found = venvs.run("bench.grpo_bench", "vllm", quick=quick)
    raw = found["grpo_vllm_run"]
    if raw["steps"] != steps:
        raise RuntimeError(f"the vLLM run took {raw['steps']} steps, not {steps}")
    results = {}
    for name, arm in raw["arms"].items():
        arm["steps"] = [g.Step(**s) for s in arm["steps"]]
        results[name] = g.Arm(**arm)
    return results, raw["seconds"]


def _figures(label: str, s: dict[str, float], tail: int, seconds: float) -> list[Figure]:
    return [
        Figure(
            f"{label}: KL(k3) R3", s["r3_kl"], "nats/token", s["live_kl"], "no replay", "<= 0.5x"
        ),
        Figure(
            f"{label}: max-step KL(k3) R3",
            s["r3_kl_max"],
            "nats/token",
            s["live_kl_max"],
            "no replay",
            "<= 0.2x",
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
        Figure(f"{label}: min agreement R3", s["r3_agreement_min"], "share", None, None, "1.000"),
        Figure(f"{label}: mean agreement no replay", s["live_agreement_mean"], "share"),
        Figure(f"{label}: clip fraction R3", s["r3_clip"], "share", s["live_clip"], "no replay"),
        Figure(f"{label}: both arms", seconds, "s"),
    ]


def run(
    quick: bool = False,
    engines: tuple[str, ...] | None = None,
    steps: int | None = None,
    plot_dir: Path | None = None,
) -> tuple[list[Figure], dict[str, object]]:
    g = _example()
    # a quick run's curves go to the temporary directory, not over the full run's
    plot_dir = plot_dir or (Path(tempfile.gettempdir()) / "r3store-grpo" if quick else RESULTS)
    steps = steps or (10 if quick else 100)
    engines = engines or ((VLLM, "bf16") if quick else (VLLM, "bf16", "fp8"))
    figures: list[Figure] = []
    details: dict[str, object] = {}
    for i, engine in enumerate(engines):
        cfg = _config(engine, steps)
        results, seconds = _vllm_arms(steps, quick) if engine == VLLM else _arms(cfg)
        tail = min(20, steps)
        s = g.summary(results, tail=tail)
        label = f"grpo {engine} engine, {steps} steps/arm" + (" (quick)" if quick else "")
        key = engine.replace(" ", "_")
        name = "grpo_r3.png" if i == 0 else f"grpo_r3_{key}.png"
        kind = "" if engine == VLLM else " (emulated)"
        title = f"GRPO on a tiny Qwen3-MoE through r3store: {engine} engine{kind}, fp32 trainer"
        g.plot(results, plot_dir / name, title + (" (quick run)" if quick else ""))
        g.write_csv(results, (plot_dir / name).with_suffix(".csv"))
        figures += _figures(label, s, tail, seconds)
        details[f"grpo_{key}"] = {
            "config": asdict(cfg),
            "summary": s,
            "plot": str((plot_dir / name).relative_to(ROOT)) if plot_dir == RESULTS else name,
            "steps": {arm: [asdict(x) for x in r.steps] for arm, r in results.items()},
        }
    return figures, details


def main() -> None:
    """The vLLM engine's arms, in vLLM's environment: their rows as JSON."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 10 if args.quick else 100
    results, seconds = _arms(_config(VLLM, steps))
    arms = {name: asdict(arm) for name, arm in results.items()}
    raw = {"steps": steps, "seconds": seconds, "arms": arms}
    args.json.write_text(json.dumps({"figures": [], "grpo_vllm_run": raw}))


if __name__ == "__main__":
    main()
