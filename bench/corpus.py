"""Realistic MoE routes for the benchmarks, recorded from tiny MoE language models trained here.

Synthetic routes (`r3store.testing.synthetic`) miss what real routers do: experts of uneven load,
choices that follow the text and repeat with it, an order of the k experts that carries the scores.
So this module trains a small byte-level decoder-only MoE transformer per shape on CPU, on half of
the Python standard library's top-level sources, then records its top-k expert ids, in score
order, over the other half: `load(shape)` gives trajectories of 512-4096 tokens as [L, T, K]
arrays and `grpo(shape)` a GRPO-shaped workload (groups of samples that share a prompt).
Everything is seeded, deterministic and cached under `bench/.corpus/`.
`python -m bench.corpus` builds it all and prints a look at the routing.
"""

from __future__ import annotations

import hashlib
import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.functional import cross_entropy, relu, scaled_dot_product_attention

VERSION = 1
SEED = 0
CACHE = Path(__file__).parent / ".corpus"
TRAINING = {"seq": 256, "batch": 8, "lr": 3e-3, "warmup": 30, "aux_weight": 0.01}
MIN_LEN, MAX_LEN = 512, 4096


@dataclass(frozen=True)
class Shape:
    """A model to train: its routing shape (layers x experts, top-k), sizes and training steps."""

    name: str
    layers: int
    experts: int
    top_k: int
    steps: int
    d_model: int = 64
    heads: int = 2
    expert_hidden: int = 32


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (Shape("8x64x4", 8, 64, 4, steps=260), Shape("16x128x8", 16, 128, 8, steps=130))
}


@dataclass
class Corpus:
    """A shape's recorded trajectories and how they were made."""

    shape: Shape
    trajectories: list[np.ndarray]  # [L, T, K] expert ids in score order
    train_loss: float  # final cross-entropy, nats per byte
    train_seconds: float
    seconds: float  # generation: training and recording


class MoE(nn.Module):
    """Linear router, softmax, top-k with renormalised gates, experts dispatched sparsely."""

    def __init__(self, d: int, hidden: int, experts: int, k: int) -> None:
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d) * hidden**-0.5)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        probs = self.router(x).softmax(-1)
        gates, ids = probs.topk(self.k)  # descending score: the order engines record
        gates = gates / gates.sum(-1, keepdim=True)
        order = ids.flatten().argsort(stable=True)
        counts = torch.bincount(ids.flatten(), minlength=len(self.w1))
        rows, weights, sizes = order // self.k, gates.flatten()[order, None], counts.tolist()
        parts = zip(torch.split(x[rows], sizes), torch.split(weights, sizes), strict=True)
        experts = zip(parts, self.w1.unbind(), self.w2.unbind(), strict=True)
        y = torch.cat([(relu(p @ w1) * g) @ w2 for (p, g), w1, w2 in experts if len(p)])
        aux = len(counts) * (counts / ids.numel() * probs.mean(0)).sum()  # Switch balance loss
        out = torch.zeros_like(x).index_add_(0, rows, y)
        return out, aux, ids


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary positions: the head dimension's two halves turned by angles [T, D/2]."""
    a, b = x.chunk(2, -1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


class Block(nn.Module):
    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads = s.heads
        self.norm1, self.norm2 = nn.RMSNorm(s.d_model), nn.RMSNorm(s.d_model)
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=False)
        self.proj = nn.Linear(s.d_model, s.d_model, bias=False)
        self.moe = MoE(s.d_model, s.expert_hidden, s.experts, s.top_k)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rotary(qkv[:2], cos, sin)
        a = scaled_dot_product_attention(q, k, qkv[2], is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        y, aux, ids = self.moe(self.norm2(x).view(b * t, d))
        return x + y.view(b, t, d), aux, ids


class Model(nn.Module):
    """Byte-level decoder-only MoE transformer: rotary positions, pre-norm, tied embeddings."""

    def __init__(self, s: Shape) -> None:
        super().__init__()
        self.heads, self.experts = s.heads, s.experts
        self.embed = nn.Embedding(256, s.d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.d_model)

    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Logits [B, T, 256], the summed auxiliary loss, expert ids [L, B*T, K]."""
        half = self.embed.embedding_dim // self.heads // 2
        angle = torch.arange(tokens.shape[1])[:, None] * 1e4 ** (-torch.arange(half) / half)
        cos, sin = angle.cos(), angle.sin()
        x, aux, ids = self.embed(tokens), torch.zeros(()), list[Tensor]()
        for block in self.blocks:
            x, a, i = block(x, cos, sin)
            aux = aux + a
            ids.append(i)
        return self.norm(x) @ self.embed.weight.T, aux, torch.stack(ids)


def _read(files: list[Path]) -> np.ndarray:
    return np.frombuffer(bytearray(b"\n".join(f.read_bytes() for f in files)), np.uint8)


def texts() -> tuple[np.ndarray, np.ndarray]:
    """The stdlib's top-level .py files as bytes: even-indexed ones to train, odd to record."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return _read(files[0::2]), _read(files[1::2])


def _deterministic(seed: int) -> np.random.Generator:
    """Seed torch and numpy; one thread, as a second one costs more than it gains (small ops)."""
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    return np.random.default_rng(seed)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps([VERSION, SEED, *parts]).encode()).hexdigest()[:10]


def _lr(step: int, steps: int) -> float:
    """Linear warmup, then a cosine from the peak down to a tenth of it."""
    warm = min(1.0, (step + 1) / TRAINING["warmup"])
    return TRAINING["lr"] * warm * (0.55 + 0.45 * math.cos(math.pi * step / steps))


def train(shape: Shape, text: np.ndarray) -> tuple[Model, float]:
    """The trained model and its final loss: the mean cross-entropy of the last 20 steps."""
    rng, model = _deterministic(SEED), Model(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=TRAINING["lr"], weight_decay=0.01, fused=True)
    seq, batch, losses = int(TRAINING["seq"]), int(TRAINING["batch"]), []
    for step in range(shape.steps):
        starts = rng.integers(0, len(text) - seq - 1, batch)
        windows = torch.from_numpy(np.stack([text[s : s + seq + 1] for s in starts])).long()
        logits, aux, _ = model(windows[:, :-1])
        ce = cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten())
        opt.param_groups[0]["lr"] = _lr(step, shape.steps)
        opt.zero_grad()
        (ce + TRAINING["aux_weight"] * aux).backward()
        opt.step()
        losses.append(ce.item())
        if step % 25 == 0 or step == shape.steps - 1:
            print(f"  {shape.name} step {step:4d} loss {ce.item():.3f}", flush=True)
    return model.eval(), float(np.mean(losses[-20:]))


@torch.no_grad()
def record(model: Model, tokens: np.ndarray) -> np.ndarray:
    """One forward pass; each layer's top-k expert ids in score order, [L, T, K]."""
    _, _, ids = model(torch.from_numpy(tokens).long()[None])
    out: np.ndarray = ids.numpy().astype(np.uint8 if model.experts <= 256 else np.uint16)
    return out


def _model(shape: Shape) -> tuple[Model, dict[str, float]]:
    """The shape's trained model and its figures, from the cache or trained now (and cached)."""
    stem = CACHE / f"{shape.name}-model-{_digest(asdict(shape), TRAINING)}"
    model = Model(shape)
    if stem.with_suffix(".json").exists():
        model.load_state_dict(torch.load(stem.with_suffix(".pt")))
        return model.eval(), json.loads(stem.with_suffix(".json").read_text())
    start = time.perf_counter()
    model, loss = train(shape, texts()[0])
    figures = {"train_loss": loss, "train_seconds": time.perf_counter() - start}
    CACHE.mkdir(exist_ok=True)
    torch.save(model.state_dict(), stem.with_suffix(".pt"))
    stem.with_suffix(".json").write_text(json.dumps(figures))
    return model, figures


def lengths(tokens: int, rng: np.random.Generator) -> list[int]:
    """Pseudo-random trajectory lengths in [MIN_LEN, MAX_LEN], adding up to at least `tokens`."""
    out: list[int] = []
    while sum(out) < tokens:
        out.append(int(rng.integers(MIN_LEN, MAX_LEN + 1)))
    return out


def load(shape_name: str, tokens: int = 256 * 1024) -> Corpus:
    """The shape's recorded trajectories, generated on first use and cached in bench/.corpus/."""
    shape = SHAPES[shape_name]
    stem = (
        CACHE / f"{shape.name}-routes-{_digest(asdict(shape), TRAINING, tokens, MIN_LEN, MAX_LEN)}"
    )
    if not stem.with_suffix(".json").exists():
        model, figures = _model(shape)
        start, text = time.perf_counter(), texts()[1]
        sizes = lengths(tokens, _deterministic(SEED + 1))
        if sum(sizes) > len(text):
            raise ValueError(f"{tokens} tokens: more than the {len(text)} bytes of recording text")
        ends = np.cumsum(sizes)
        routes = [record(model, text[e - n : e]) for e, n in zip(ends, sizes, strict=True)]
        figures["seconds"] = figures["train_seconds"] + time.perf_counter() - start
        np.savez(stem.with_suffix(".npz"), routes=np.concatenate(routes, 1), sizes=sizes)
        stem.with_suffix(".json").write_text(json.dumps(figures))
    with np.load(stem.with_suffix(".npz")) as npz:
        parts = np.split(npz["routes"], np.cumsum(npz["sizes"])[:-1], axis=1)
    return Corpus(shape, parts, **json.loads(stem.with_suffix(".json").read_text()))


def _group(
    model: Model, text: np.ndarray, starts: np.ndarray, prompt: int, tokens: int
) -> np.ndarray:
    """One GRPO group, [size, L, tokens, K]: the prompt at starts[0], continuations at the rest."""
    head = text[starts[0] : starts[0] + prompt]
    tails = (text[s : s + tokens - prompt] for s in starts[1:])
    return np.stack([record(model, np.concatenate([head, tail])) for tail in tails])


def grpo(
    shape_name: str,
    groups: int = 16,
    size: int = 8,
    prompt_fraction: float = 0.5,
    tokens: int = 1024,
) -> list[list[tuple[np.ndarray, int]]]:
    """Groups of `size` samples that share a prompt, each with its own continuation (excerpts of
    the recording text): per sample, the routes of one forward pass over prompt + continuation,
    [L, tokens, K], and the prompt's length. Generated on first use and cached."""
    shape, prompt = SHAPES[shape_name], int(prompt_fraction * tokens)
    digest = _digest(asdict(shape), TRAINING, groups, size, prompt, tokens)
    path = CACHE / f"{shape.name}-grpo-{digest}.npy"
    if not path.exists():
        model, text = _model(shape)[0], texts()[1]
        starts = _deterministic(SEED + 2).integers(0, len(text) - tokens, (groups, size + 1))
        part = path.with_suffix(".part.npy")  # renamed when complete: no half file is read
        np.save(part, np.stack([_group(model, text, g, prompt, tokens) for g in starts]))
        part.replace(path)
    return [[(r, prompt) for r in group] for group in np.load(path)]


def prompt_agreement(groups: list[list[tuple[np.ndarray, int]]]) -> tuple[int, int]:
    """How many samples (after each group's first) have prompt routes byte-equal to the first's."""
    same = sum(
        np.array_equal(r[:, :n], group[0][0][:, :n]) for group in groups for r, n in group[1:]
    )
    return same, sum(len(group) - 1 for group in groups)


def routing(routes: list[np.ndarray], experts: int) -> tuple[float, float]:
    """Means over layers: the share of token-slots the 10% most-loaded experts take, and the
    entropy in bits of the experts' distribution (log2(experts) when uniform, 0 collapsed)."""
    ids = np.concatenate(routes, 1)
    p = np.stack([np.bincount(layer.ravel(), minlength=experts) for layer in ids]) / ids[0].size
    top = np.sort(p, 1)[:, ::-1][:, : max(1, round(experts / 10))].sum(1)
    entropy = -(p * np.log2(np.where(p > 0, p, 1))).sum(1)
    return float(top.mean()), float(entropy.mean())


def main() -> None:
    for name, shape in SHAPES.items():
        corpus, groups = load(name), grpo(name)
        top, entropy = routing(corpus.trajectories, shape.experts)
        tokens = sum(t.shape[1] for t in corpus.trajectories)
        print(
            f"{name}: trained in {corpus.train_seconds:.0f} s to loss {corpus.train_loss:.3f} "
            f"nats/byte, generated in {corpus.seconds:.0f} s; {len(corpus.trajectories)} "
            f"trajectories, {tokens} tokens; the top 10% of experts take {top:.1%} of the slots, "
            f"entropy {entropy:.2f} bits of log2(E) = {math.log2(shape.experts):.0f}",
            flush=True,
        )
        same, total = prompt_agreement(groups)
        print(f"  GRPO: {same}/{total} samples' prompt routes equal their group's first")


if __name__ == "__main__":
    main()
