"""GRPO on a tiny MoE through an r3store server, with and without Rollout Routing Replay.

The tiny Qwen3-MoE of `r3_mismatch.py` (4 layers, 64 experts, top-8, built from a
config) is first trained briefly as a byte-level language model on the standard
library's Python sources, so that its outputs depend on which experts run. Then a real
GRPO loop runs, once per arm, from the same weights and with the same seeds:

- the engine, a bf16 copy of the policy (`--engine-dtype`: bf16 emulated on the CPU,
  see `PRECISIONS`; `fp8` for an FP8 rollout engine's wider gap), samples a group of
  `--group` responses per prompt at temperature 1 with a KV cache, recording the
  experts each router chose and the log-probability of each sampled token; an
  `AsyncRolloutWriter` (as an asyncio rollout loop writes) sends the routes and token
  ids to r3store, tagged with the policy version and the group, and answers each
  trajectory's route ref once stored;
- the trainer, fp32, leases a step's groups whole from the namespace (the server
  applies the staleness window and counts each trajectory once, on commit), runs a
  full forward over them replaying the engine's experts (arm `R3`) or with its own
  routers (arm `no replay`), takes one GRPO/PPO-clip step with the importance ratio
  against the engine's log-probabilities, uploads the experts it ran as the `trainer`
  source, commits the lease and moves the namespace's policy version on; the engine's
  weights are then refreshed from the trainer's.

Task: the reward of a response is the fraction of its bytes that are lowercase vowels
(`aeiou`); GRPO's advantage is the reward less its group's mean, over the group's
standard deviation. Per step it prints the mean reward, the training-inference KL on
the sampled tokens (the k3 estimator, `r - 1 - log r` with `r` the trainer's over the
engine's probability of the sampled token; the tokens are the engine's samples, so it
estimates KL(engine || trainer)), the share of tokens with `r` above 2 or below 1/2,
the PPO clip fraction, the gradient norm (before clipping), and the routing agreement
between the engine and the trainer the server computed from the uploads (under replay,
the experts the trainer actually ran: 1.000).

    make serve &                                    # the service, as it is
    python examples/grpo_r3.py                      # a few minutes on 2 cores
    python examples/grpo_r3.py --own-server --steps 100 --plot grpo.png --cache /tmp/lm

`--engine vllm` runs the rollout on vLLM instead (`grpo_vllm.py`, in vLLM's environment:
`make test-vllm` builds `.venv-vllm`): vLLM serves the policy in bf16 or fp32 with its own
CPU kernels, vLLM's own capture records its routes, they reach r3store as vLLM delivers
them (`from_vllm`, stored as sets), and the trainer's weights are loaded into the running
engine after each step (vLLM's `reload_weights`):

    .venv-vllm/bin/python examples/grpo_r3.py --own-server --engine vllm --steps 100

`python -m bench --only grpo` runs it 100 steps per arm, with the vLLM engine (bf16) and
the emulated bf16 and fp8 engines (`bench/grpo_bench.py`; figures and plots in
`bench/results/`).

`--ahead 1` makes the engine run one step ahead of the trainer (trained data one policy
version old, the namespace's staleness window one version wide).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from r3_mismatch import EXPERTS, LAYERS, TOP_K, corpus, model, train

from r3store.policy import NamespaceSettings
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.service import start_server, stop_server
from r3store_client import AsyncClient, AsyncRolloutWriter, Client
from r3store_client.replay import RouterReplay
from r3store_client.tensors import padded

VOWELS = torch.zeros(256, dtype=torch.bool)
VOWELS[list(b"aeiou")] = True
ARMS = ("R3", "no replay")
# The engine's precision. `bf16` and `fp16` emulate a GPU's half-precision kernels on the
# CPU, where native bf16 matmuls are several times slower than fp32 ones: the weights are
# rounded to the format and so is every module's output (the inputs of the next), the
# arithmetic in between accumulating in fp32, as tensor cores do. `bf16-native` runs the
# CPU's own bf16 kernels instead; `fp32` has no numeric gap to the trainer but its
# kernel path (a KV cache, one token at a time). `fp8` is an FP8 rollout engine as
# deployed (a bf16 model whose experts' and attention's weights are quantised to
# float8 e4m3, a scale per output row; the routers, embeddings and head stay bf16).
PRECISIONS = ("bf16", "fp8", "fp16", "bf16-native", "fp32")
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Config:
    steps: int = 20
    seed: int = 0
    pretrain: int = 150  # language-model steps before RL
    prompts: int = 4  # prompts per step
    group: int = 8  # responses per prompt
    prompt_len: int = 16
    response_len: int = 16
    lr: float = 1e-4
    clip: float = 0.2
    ahead: int = 0  # the engine runs this many steps ahead of the trainer
    engine_dtype: str = "bf16"
    engine: str = "emulated"  # or "vllm": the rollout on vLLM (`grpo_vllm.py`)
    layers: int = LAYERS  # the model's shape
    experts: int = EXPERTS
    top_k: int = TOP_K


@dataclass
class Step:
    """One step of one arm."""

    step: int
    version: int  # the policy version trained (the namespace's, before moving on)
    reward: float
    kl: float
    extreme: float
    clip: float
    grad_norm: float
    agreement: float  # the server's, engine vs trainer uploads of the data's version
    own_agreement: float  # the trainer's own routers vs the engine's (replay arm: unused)
    oldest: int  # the oldest policy version among the trained trajectories
    trajectories: int
    used_match: float  # share of token-layers whose experts run were the engine's


@dataclass
class Arm:
    name: str
    namespace: str
    steps: list[Step] = field(default_factory=list)
    leases: int = 0
    commits: int = 0
    seconds: float = 0.0


def reward(responses: torch.Tensor) -> torch.Tensor:
    """The fraction of each response's bytes that are lowercase vowels."""
    return VOWELS[responses].float().mean(-1)


def engine_copy(policy: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of `policy` computing in `precision` (`PRECISIONS`); its weights are
    rounded by `round_weights`."""
    engine = copy.deepcopy(policy).eval()
    if precision == "bf16-native":
        return engine.to(torch.bfloat16)
    engine.float()
    if precision in HALF or precision == "fp8":
        half = HALF.get(precision, torch.bfloat16)
        engine.requires_grad_(False)

        def rounded(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(half).to(value.dtype)
            if isinstance(value, tuple):
                return tuple(rounded(v) for v in value)
            return value

        for module in engine.modules():
            if module is not engine:
                module.register_forward_hook(lambda _m, _i, out: rounded(out))
    return engine


@torch.no_grad()
def round_weights(net: torch.nn.Module, precision: str) -> None:
    """The weights rounded to `precision`'s half format; for `fp8`, the experts' and
    the attention projections' to float8 e4m3 first, with a scale per output row."""
    if precision not in HALF and precision != "fp8":
        return
    half = HALF.get(precision, torch.bfloat16)
    for name, p in net.named_parameters():
        if precision == "fp8" and p.dim() >= 2 and (".experts." in name or "_proj" in name):
            scale = p.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
            p.copy_((p / scale).to(torch.float8_e4m3fn).to(p.dtype) * scale)
        p.copy_(p.to(half).to(p.dtype))


class Emulated:
    """The engine as the trainer's own model, computing in `precision` (`PRECISIONS`)."""

    ordered = True  # the model's routers give their experts in rank order

    def __init__(self, policy: torch.nn.Module, precision: str) -> None:
        self.precision = precision
        self.net = engine_copy(policy, precision)
        round_weights(self.net, precision)

    def load(self, net: torch.nn.Module) -> None:
        """`net`'s weights into the engine (in the engine's format)."""
        with torch.no_grad():
            for mine, theirs in zip(self.net.parameters(), net.parameters(), strict=True):
                mine.copy_(theirs)
        round_weights(self.net, self.precision)

    def generate(
        self, prompts: torch.Tensor, length: int, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        gen = torch.Generator().manual_seed(seed)
        seqs, logps, routes = generate(self.net, prompts, length, gen)
        return seqs, logps, routes.numpy()

    @staticmethod
    def write(trajectory_id: str, routes: np.ndarray, **meta: Any) -> TrajectoryWrite:
        return TrajectoryWrite(trajectory_id, routes.shape[0], topk=routes, **meta)

    def close(self) -> None:
        pass


def engine_for(cfg: Config, policy: torch.nn.Module) -> Any:
    """The rollout engine `cfg.engine` names, serving `policy`."""
    if cfg.engine == "vllm":
        from grpo_vllm import VllmEngine

        return VllmEngine(policy, cfg.engine_dtype, max_seqs=cfg.prompts * cfg.group)
    return Emulated(policy, cfg.engine_dtype)


@contextmanager
def routes_of(net: torch.nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Per router (layer), the experts it handed its MoE block in each forward inside:
    under replay, the replayed ones (what actually ran)."""
    calls: list[list[torch.Tensor]] = []
    routers = RouterReplay(net).routers

    def hook(layer: int) -> Callable[..., None]:
        def record(_m: torch.nn.Module, _i: Any, out: Any) -> None:
            if layer == 0:
                calls.append([])
            calls[-1].append(out[2].detach().clone())

        return record

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token-layer: whether the two top-k sets are equal (`[..., K]` each)."""
    return (a.long().sort(-1).values == b.long().sort(-1).values).all(-1)


@torch.no_grad()
def generate(
    engine: torch.nn.Module, prompts: torch.Tensor, length: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample `length` tokens per prompt at temperature 1 with a KV cache. Returns the
    sequences `[B, P + length]`, the log-probability of each sampled token `[B, length]`
    (fp32, of the engine's logits), and the experts each token fed to the model was
    routed to, `[B, P + length - 1, L, K]` (the last sample is never fed)."""
    b = prompts.shape[0]
    tokens = prompts
    logps: list[torch.Tensor] = []
    with routes_of(engine) as calls:
        out = engine(input_ids=prompts, use_cache=True)
        for i in range(length):
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)
            nxt = torch.multinomial(logp.exp(), 1, generator=gen)
            logps.append(logp.gather(-1, nxt)[:, 0])
            tokens = torch.cat([tokens, nxt], 1)
            if i + 1 < length:
                out = engine(input_ids=nxt, cache=out.cache, use_cache=True)
    routes = torch.cat(
        [torch.stack([x.reshape(b, -1, x.shape[-1]) for x in layers], 2) for layers in calls], 1
    )
    return tokens, torch.stack(logps, 1), routes.to(torch.int32)


class Loop:
    """One arm's GRPO loop against one namespace."""

    def __init__(
        self,
        cfg: Config,
        arm: str,
        client: Client,
        namespace: str,
        policy: torch.nn.Module,
        data: np.ndarray,
        engine: Any,
        log: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.arm, self.client, self.ns, self.data = cfg, arm, client, namespace, data
        self.log = log
        self.trainer = copy.deepcopy(policy).float().eval()
        self.engine = engine
        engine.load(policy)
        self.spec = RouteSpec(cfg.layers, cfg.experts, cfg.top_k, ordered=engine.ordered)
        self.replayer = RouterReplay(self.trainer, self.spec)
        self.opt = torch.optim.AdamW(self.trainer.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.rollouts: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.engine_routes: dict[str, torch.Tensor] = {}
        self.version = 0
        self.result = Arm(arm, namespace)
        self.aio = asyncio.new_event_loop()  # the engine's rollout loop (`run` closes it)
        lag = cfg.ahead
        client.create_namespace(
            namespace, self.spec, NamespaceSettings(max_policy_lag=lag, max_times_sampled=1)
        )

    # the engine

    def rollout(self, writer: AsyncRolloutWriter, batch: int) -> None:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, batch])
        starts = rng.integers(0, len(self.data) - cfg.prompt_len, cfg.prompts)
        prompts = torch.from_numpy(
            np.stack([self.data[s : s + cfg.prompt_len] for s in starts]).astype(np.int64)
        ).repeat_interleave(cfg.group, 0)
        seed = cfg.seed * 1_000_003 + batch
        seqs, logps, routes = self.engine.generate(prompts, cfg.response_len, seed)
        writes = []
        for i in range(seqs.shape[0]):
            tid = f"b{batch}/p{i // cfg.group}/s{i % cfg.group}"
            self.rollouts[tid] = (seqs[i], logps[i], self.version)
            self.engine_routes[tid] = torch.from_numpy(routes[i].astype(np.int64))
            writes.append(  # the tokens fed to the engine: all but the last sample
                self.engine.write(
                    tid,
                    routes[i],
                    token_ids=seqs[i, :-1].numpy().astype(np.int32),
                    prompt_len=cfg.prompt_len,
                    group_id=f"b{batch}/p{i // cfg.group}",
                    policy_version=self.version,
                )
            )

        async def put_all() -> None:  # the group's samples written concurrently
            refs = await asyncio.gather(*(writer.put(w) for w in writes))
            if len(refs) != len(writes):
                raise RuntimeError(f"the writer did not deliver batch {batch}: {writer.report}")

        self.aio.run_until_complete(put_all())

    # the trainer

    def train_step(self, step: int) -> Step:
        cfg = self.cfg
        n = cfg.prompts * cfg.group
        lease = self.client.lease(self.ns, n=n, whole_groups=True)
        self.result.leases += 1
        batch = self.client.read_lease(lease)
        items = batch.found
        if len(items) != n or batch.missing or batch.stale:
            raise RuntimeError(f"step {step}: leased {len(items)} of {n} trajectories")
        oldest = min(item.policy_version for item in items)
        floor = self.version - cfg.ahead
        if oldest < floor:
            raise RuntimeError(f"step {step}: trained version {oldest} below the window {floor}")
        routes = padded(batch, self.spec)
        stored = [item.token_ids for item in items]
        if any(tokens is None for tokens in stored):
            raise RuntimeError(f"step {step}: a trajectory came without its token ids")
        inputs = torch.from_numpy(np.stack([t for t in stored if t is not None])).long()
        seqs = torch.stack([self.rollouts[item.trajectory_id][0] for item in items])
        if not torch.equal(seqs[:, :-1], inputs):
            raise RuntimeError(f"step {step}: the stored tokens are not the engine's")
        engine_logp = torch.stack([self.rollouts[item.trajectory_id][1] for item in items])
        engine_routes = torch.stack([self.engine_routes[item.trajectory_id] for item in items])
        versions = {item.policy_version for item in items}

        rewards = reward(seqs[:, cfg.prompt_len :])
        grouped = rewards.view(-1, cfg.group)
        adv = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)
        adv = adv.view(-1, 1)

        self.trainer.train()
        with routes_of(self.trainer) as calls:
            if self.arm == "R3":
                with self.replayer.replay(routes):
                    logits = self.trainer(input_ids=inputs).logits
                own = float(np.mean(self.replayer.agreement))
            else:
                logits = self.trainer(input_ids=inputs).logits
        self.trainer.eval()
        used = torch.stack([x.reshape(len(items), -1, cfg.top_k) for x in calls[0]], 2)
        match = same_sets(used, engine_routes)
        if self.arm != "R3":
            own = float(match.float().mean())
        p = cfg.prompt_len
        targets = seqs[:, p:]
        logp = torch.log_softmax(logits[:, p - 1 :].float(), -1).gather(-1, targets[..., None])
        logp = logp[..., 0]
        log_ratio = logp - engine_logp
        ratio = log_ratio.exp()
        clipped = ratio.clamp(1 - cfg.clip, 1 + cfg.clip)
        loss = -torch.min(ratio * adv, clipped * adv).mean()
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainer.parameters(), 1.0))
        self.opt.step()

        with torch.no_grad():
            r = ratio.detach()
            kl = float((r - 1 - log_ratio.detach()).mean())
            extreme = float(((r > 2) | (r < 0.5)).float().mean())
            clip = float(((r - 1).abs() > cfg.clip).float().mean())

        # the trainer's routes (the experts it ran) as the `trainer` source
        num_tokens = inputs.shape[1]
        self.client.put(
            self.ns,
            [
                TrajectoryWrite(
                    item.trajectory_id, num_tokens, topk=used[i].numpy(), source="trainer"
                )
                for i, item in enumerate(items)
            ],
        )
        stats = self.client.agreement(self.ns)
        agree = [v.overall for v in stats.versions if v.policy_version in versions]
        agreement = float(np.mean([a for a in agree if a is not None])) if agree else math.nan
        self.client.commit(lease)
        self.result.commits += 1
        for item in items:
            del self.rollouts[item.trajectory_id], self.engine_routes[item.trajectory_id]
        trained = self.version
        self.version = self.client.set_policy_version(self.ns, self.version + 1).policy_version
        if self.version != trained + 1:
            raise RuntimeError(f"the policy version moved to {self.version}, not {trained + 1}")
        self.engine.load(self.trainer)
        return Step(
            step,
            trained,
            float(rewards.mean()),
            kl,
            extreme,
            clip,
            grad_norm,
            agreement,
            own,
            oldest,
            len(items),
            float(match.float().mean()),
        )

    def run(self) -> Arm:
        started = time.perf_counter()
        self.log(f"\narm {self.arm}: {self.cfg.steps} steps, namespace {self.ns!r}")
        self.log(header())
        aclient = AsyncClient(self.client.base_url, api_key=self.client.api_key)
        writer = AsyncRolloutWriter(aclient, self.ns)
        try:
            batch = 0
            for _ in range(self.cfg.ahead):  # fill the pipeline
                self.rollout(writer, batch)
                batch += 1
            for step in range(self.cfg.steps):
                self.rollout(writer, batch)
                batch += 1
                s = self.train_step(step)
                self.result.steps.append(s)
                self.log(row(s))
        finally:
            self.aio.run_until_complete(writer.close())
            self.aio.run_until_complete(aclient.aclose())
            self.aio.close()
        self.result.seconds = time.perf_counter() - started
        return self.result


def header() -> str:
    return (
        f"{'step':>5}{'ver':>5}{'reward':>9}{'KL(k3)':>11}{'extreme':>9}{'clip':>8}"
        f"{'|grad|':>8}{'agree':>8}{'own':>7}"
    )


def row(s: Step) -> str:
    return (
        f"{s.step:5d}{s.version:5d}{s.reward:9.3f}{s.kl:11.2e}{s.extreme:9.4f}{s.clip:8.4f}"
        f"{s.grad_norm:8.3f}{s.agreement:8.3f}{s.own_agreement:7.3f}"
    )


def pretrained(
    cfg: Config, data: np.ndarray, log: Callable[[str], None] = print, cache: Path | None = None
) -> Any:
    """The policy before RL: trained `cfg.pretrain` steps as a language model (kept in
    `cache`, a directory, when given: the same seed and steps load it again)."""
    net = model(cfg.seed, cfg.layers, cfg.experts, cfg.top_k)
    shape = (
        ""
        if (cfg.layers, cfg.experts, cfg.top_k) == (LAYERS, EXPERTS, TOP_K)
        else (f"-{cfg.layers}x{cfg.experts}top{cfg.top_k}")
    )
    name = f"lm-seed{cfg.seed}-steps{cfg.pretrain}{shape}.pt"
    saved = None if cache is None else cache / name
    if saved is not None and saved.exists():
        log(f"pretrained weights from {saved}")
        net.load_state_dict(torch.load(saved))
        return torch.nn.Module.eval(net)
    log(
        f"pretraining a tiny Qwen3-MoE ({cfg.layers} layers, {cfg.experts} experts, "
        f"top-{cfg.top_k}) "
        f"for {cfg.pretrain} steps as a byte-level language model"
    )
    train(net, data, cfg.pretrain, cfg.seed)
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), saved)
    return net


def run_arms(
    cfg: Config,
    url: str,
    arms: tuple[str, ...] = ARMS,
    log: Callable[[str], None] = print,
    cache: Path | None = None,
) -> dict[str, Arm]:
    """Both arms from the same pretrained weights and seeds, each in a namespace of
    its own on the server at `url`."""
    data = corpus("*.py")
    net = pretrained(cfg, data, log, cache)
    tag = uuid.uuid4().hex[:6]
    results = {}
    engine = engine_for(cfg, net)  # one per run: each arm loads the policy into it
    try:
        with Client(url) as client:
            for arm in arms:
                ns = f"grpo-{'r3' if arm == 'R3' else 'live'}-{tag}"
                torch.manual_seed(cfg.seed)
                results[arm] = Loop(cfg, arm, client, ns, net, data, engine, log).run()
    finally:
        engine.close()
    return results


def summary(results: dict[str, Arm], tail: int = 20) -> dict[str, float]:
    """The figures of the comparison: means over all steps (KL, extreme tokens, clip),
    the mean reward of the final `tail` steps, the least agreement under replay."""
    out: dict[str, float] = {}
    for name, arm in results.items():
        key = "r3" if name == "R3" else "live"
        steps = arm.steps
        out[f"{key}_kl"] = float(np.mean([s.kl for s in steps]))
        out[f"{key}_kl_max"] = float(max(s.kl for s in steps))
        out[f"{key}_extreme"] = float(np.mean([s.extreme for s in steps]))
        out[f"{key}_clip"] = float(np.mean([s.clip for s in steps]))
        out[f"{key}_reward_first"] = float(np.mean([s.reward for s in steps[:tail]]))
        out[f"{key}_reward_final"] = float(np.mean([s.reward for s in steps[-tail:]]))
        out[f"{key}_agreement_min"] = float(min(s.agreement for s in steps))
        out[f"{key}_agreement_mean"] = float(np.mean([s.agreement for s in steps]))
        out[f"{key}_own_agreement"] = float(np.mean([s.own_agreement for s in steps]))
        out[f"{key}_seconds"] = arm.seconds
    if "r3_kl" in out and "live_kl" in out:
        out["kl_ratio"] = out["r3_kl"] / out["live_kl"] if out["live_kl"] else math.nan
        ex = out["live_extreme"]
        out["extreme_ratio"] = out["r3_extreme"] / ex if ex else math.nan
    return out


def write_csv(results: dict[str, Arm], path: Path) -> None:
    """The per-step rows of each arm, one line each."""
    names = [f.name for f in dataclasses.fields(Step)]
    lines = [",".join(["arm", *names])]
    for name, arm in results.items():
        lines += [",".join([name, *(f"{getattr(s, n):.6g}" for n in names)]) for s in arm.steps]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def plot(results: dict[str, Arm], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("reward", "reward (vowel fraction)", False),
        ("kl", "training-inference KL (k3)", True),
        ("extreme", "extreme tokens (ratio >2 or <1/2)", False),
        ("clip", "clip fraction", False),
        ("grad_norm", "gradient norm", False),
        ("agreement", "engine/trainer routing agreement", False),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    colors = {"R3": "tab:blue", "no replay": "tab:red"}
    for ax, (key, label, log) in zip(axes.flat, panels, strict=True):
        for name, arm in results.items():
            xs = [s.step for s in arm.steps]
            ys = [getattr(s, key) for s in arm.steps]
            ax.plot(xs, ys, label=name, color=colors.get(name), lw=1.2)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step", fontsize=9)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes.flat[0].legend()
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Arm]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    parser.add_argument("--steps", type=int, default=defaults.steps, help="GRPO steps per arm")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--pretrain", type=int, default=defaults.pretrain)
    parser.add_argument("--prompts", type=int, default=defaults.prompts)
    parser.add_argument("--group", type=int, default=defaults.group)
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--response-len", type=int, default=defaults.response_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--experts", type=int, default=defaults.experts)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--ahead", type=int, default=defaults.ahead)
    parser.add_argument("--engine-dtype", choices=PRECISIONS, default=defaults.engine_dtype)
    parser.add_argument(
        "--engine",
        choices=["emulated", "vllm"],
        default=defaults.engine,
        help="the rollout on the policy's own copy, or on vLLM (bf16 or fp32; vLLM's env)",
    )
    parser.add_argument("--arms", choices=["both", "r3", "live"], default="both")
    parser.add_argument("--url", default=os.environ.get("R3STORE_URL", "http://127.0.0.1:8330"))
    parser.add_argument("--own-server", action="store_true", help="start a server of its own")
    parser.add_argument("--plot", type=Path, help="write the curves to this PNG")
    parser.add_argument("--cache", type=Path, help="a directory to keep the pretrained weights")
    args = parser.parse_args(argv)
    cfg = Config(
        steps=args.steps,
        seed=args.seed,
        pretrain=args.pretrain,
        prompts=args.prompts,
        group=args.group,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        lr=args.lr,
        ahead=args.ahead,
        engine_dtype=args.engine_dtype,
        engine=args.engine,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
    )
    arms = {"both": ARMS, "r3": ("R3",), "live": ("no replay",)}[args.arms]
    # one thread per core, no more: oversubscribing a busy machine makes it far slower
    torch.set_num_threads(max(1, min(4, len(os.sched_getaffinity(0)))))
    if args.own_server:
        with tempfile.TemporaryDirectory(prefix="grpo-r3-") as tmp:
            server, url = start_server(Path(tmp))
            try:
                results = run_arms(cfg, url, arms, cache=args.cache)
            finally:
                stop_server(server)
    else:
        results = run_arms(cfg, args.url, arms, cache=args.cache)
    figures = summary(results, tail=min(20, cfg.steps))
    print(f"\nconfig: {asdict(cfg)}")
    for name, arm in results.items():
        print(f"arm {name}: {arm.leases} leases, {arm.commits} commits, {arm.seconds:.0f} s")
    for key, value in figures.items():
        print(f"  {key:24}{value:.4g}")
    if args.plot:
        engine = f"{cfg.engine_dtype} {'vLLM' if cfg.engine == 'vllm' else 'emulated'} engine"
        plot(results, args.plot, f"GRPO on a tiny Qwen3-MoE, {engine}")
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
