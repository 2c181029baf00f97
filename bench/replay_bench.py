"""What the token check costs a replayed forward: the tests' models (Megatron-Core's tiny
`GPTModel` of `tests/megatron_world.py`, on CPU with its shims; HF's tiny Qwen3-MoE of
`tests/hf_tiny.py`), each micro-batch loaded and replayed in `eval`/`no_grad`, with the
check on and off side by side in one run: the two alternate call by call within every
repeat, each call timed in the thread's CPU time (one torch thread: the work is this
thread's); the figure is the median of the repeats without the check, plus the median
of the repeats' paired differences.

The check is a handful of element-wise kernels per micro-batch and one host read at its
end, so it weighs most on the smallest forward: the tests' micro-batch of 2 x 8 tokens.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.figures import Figure

TESTS = Path(__file__).resolve().parent.parent / "tests"


def _side_by_side(
    on: Callable[[], None], off: Callable[[], None], calls: int, repeats: int
) -> tuple[float, float]:
    """Seconds per call of `on` and of `off`, side by side: the two alternate call by
    call (which goes first alternating too), each call timed in this thread's CPU time
    (so other processes weigh on neither); `off` is the median of the repeats' means,
    `on` adds the median of the repeats' mean paired differences (a pair is one call
    of each, next to each other: slow drifts of the machine cancel)."""
    on(), off()  # warm up
    offs, extra = [], []
    for _ in range(repeats):
        spent = {True: 0.0, False: 0.0}
        for i in range(calls):
            for check in (True, False) if i % 2 else (False, True):
                start = time.thread_time()
                (on if check else off)()
                spent[check] += time.thread_time() - start
        offs.append(spent[False] / calls)
        extra.append((spent[True] - spent[False]) / calls)
    base = statistics.median(offs)
    return base + statistics.median(extra), base


def _figure(what: str, shape: tuple[int, int], on: float, off: float) -> Figure:
    return Figure(
        f"replayed forward, {what} {shape[0]}x{shape[1]}, token check on",
        on * 1e3,
        "ms",
        off * 1e3,
        "token check off",
        "< 1.05x",
    )


def _routes(ids: Any, valid: Any, tokens: Any) -> Any:
    """The `RouteTensors` a `b` x `s` batch of `tokens` replays: the recorded `ids`,
    `valid` where a route was recorded, every trajectory ("t0", "t1", ...) `s` tokens."""
    import torch

    from r3store_client.tensors import Origin, RouteTensors

    b, s = tokens.shape
    return RouteTensors(
        ids,
        valid,
        torch.tensor([s] * b, dtype=torch.int32),
        None,
        tokens.to(torch.int32),
        Origin("bench", tuple(f"t{i}" for i in range(b))),
    )


def megatron_case(b: int, s: int, repeats: int) -> Figure:
    """The Megatron test model replaying a `b` x `s` micro-batch (in `cpu_shims`)."""
    import torch

    from megatron_world import causal_mask, tiny_config, tiny_gpt
    from r3store.spec import RouteSpec
    from r3store_client.megatron import MegatronReplay, TokenLayout, gather_recorded

    spec = RouteSpec(2, 8, 2)
    torch.manual_seed(0)
    model = tiny_gpt(tiny_config(), seq=s).eval()
    replay = MegatronReplay(model, spec)
    tokens = torch.randint(0, 64, (b, s), generator=torch.Generator().manual_seed(1))
    positions, mask = torch.arange(s).expand_as(tokens), causal_mask(s)
    layout = TokenLayout.sbhd([s] * b, s)
    with torch.no_grad(), replay.record() as recorded:
        model(tokens, positions, mask)
    ids, seen = gather_recorded(recorded, layout, replay.layers, spec)
    routes = _routes(ids, seen[..., None].expand(ids.shape).clone(), tokens)

    def step(check: bool) -> None:
        replay.check_tokens = check
        with torch.no_grad(), replay.micro_batch(routes, layout):
            model(tokens, positions, mask)

    calls = max(5, 4096 // (b * s))
    on, off = _side_by_side(lambda: step(True), lambda: step(False), calls, repeats)
    replay.detach()
    return _figure("Megatron test model", (b, s), on, off)


def hf_case(model: Any, b: int, s: int, repeats: int) -> Figure:
    """The HF test model replaying a `b` x `s` batch."""
    import torch

    from r3store_client.replay import RouterReplay

    tokens = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(1))
    replayer = RouterReplay(model)
    with torch.no_grad(), replayer.record() as recorded:
        model(input_ids=tokens)
    ids = recorded.ids
    routes = _routes(ids, torch.ones(ids.shape, dtype=torch.bool), tokens)

    def step(check: bool) -> None:
        replayer.check_tokens = check
        with torch.no_grad(), replayer.replay(routes):
            model(input_ids=tokens)

    calls = max(5, 4096 // (b * s))
    on, off = _side_by_side(lambda: step(True), lambda: step(False), calls, repeats)
    return _figure("HF test model (Qwen3-MoE)", (b, s), on, off)


def hf_model() -> Any:
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from hf_tiny import COMMON, TINY

    model_type, auto, _router, kwargs = TINY["qwen3_moe"]
    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type](**{**COMMON, **kwargs})
    return getattr(transformers, auto).from_config(config).eval()


def run(quick: bool = False) -> list[Figure]:
    import torch

    sys.path.insert(0, str(TESTS))  # the tests' models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        repeats = 5 if quick else 21
        from megatron_world import cpu_shims, world

        with cpu_shims(), world():
            figures = [megatron_case(b, s, repeats) for b, s in ((2, 8), (4, 256))]
        model = hf_model()
        return figures + [hf_case(model, b, s, repeats) for b, s in ((2, 8), (4, 64))]
    finally:
        torch.set_num_threads(threads)
