"""Routes from vLLM, through r3store, replayed in the HF model and in Megatron-Core.

A tiny Qwen3-MoE (seeded random weights, built in code, no downloads) is served by vLLM
on the CPU, in fp32 and in bf16; it samples a handful of prompts at temperature 1 and
returns the whole vocabulary's log-probabilities at every sampled token (vLLM's raw
logprobs: the distribution each token was drawn from). vLLM's own
`RoutedExpertsCapturer` records the experts its routers chose (`tests_vllm/vllm_engine.py`
says how it is bound on the CPU). The routes go to an r3store server (embedded store,
loopback) as vLLM's `routed_experts` (`from_vllm`), the refs of the puts are kept, and
the trainer resolves them. The trainers, each from the same weights, in fp32 and bf16:

- the HF model, with its own routers and replaying vLLM's routes (`RouterReplay`);
- a Megatron-Core `GPTModel` (local layers, CPU, one gloo rank: `tests/megatron_world.py`)
  loaded from the HF weights, with its own routers and replaying the same routes
  through Megatron's `RouterReplay` (`MegatronReplay`).

Per trainer it prints how often its own routers pick vLLM's expert sets (MoE
token-layers of the prompt and the sampled tokens), whether the replayed routers ran
exactly vLLM's experts (checked, layer by layer, token by token), and the mean
KL(vLLM || trainer) of the next-token distribution over the whole vocabulary at every
sampled token, without and with replay.

    python examples/vllm_r3.py [--prompts 8] [--new-tokens 24] [--init-std 0.3]

in vLLM's environment (`make test-vllm` builds it, megatron-core included; about 20 s on
2 cores; `--no-megatron` leaves Megatron out). The weights are drawn at std 0.3 so that
the outputs depend on the experts; at HF's default (0.02) the next-token distributions
are nearly uniform. docs/integrations.md ("vLLM") has the figures.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "tests", ROOT / "tests_vllm"):  # the engine side, Megatron's CPU shims
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from vllm_engine import QWEN3_MOE, VOCAB, Sampled, build, capturing, engine, sample  # noqa: E402

from r3store.refs import RouteRef  # noqa: E402
from r3store.spec import RouteSpec  # noqa: E402
from r3store.testing.service import start_server, stop_server  # noqa: E402
from r3store_client import Client  # noqa: E402
from r3store_client.convert import from_vllm  # noqa: E402
from r3store_client.reader import TrainerReader  # noqa: E402
from r3store_client.replay import RouterReplay, same_sets  # noqa: E402
from r3store_client.tensors import CompactRoutes  # noqa: E402

TINY = QWEN3_MOE
SPEC = RouteSpec(len(TINY.moe_layers), TINY.num_experts, TINY.top_k)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Request:
    """One sampled request: vLLM's tokens and logprobs, its routes `[T - 1, L, K]` (MoE
    layers), and what r3store gave back for them (its put's ref, resolved)."""

    sampled: Sampled
    routes: np.ndarray
    ref: RouteRef | None = None
    resolved: CompactRoutes | None = None

    @property
    def batch(self) -> torch.Tensor:
        return torch.tensor([self.sampled.tokens])

    @property
    def scored(self) -> slice:
        """The positions whose next-token distribution made a sampled token."""
        return slice(self.sampled.prompt_len - 1, len(self.sampled.tokens) - 1)


@dataclass
class Figures:
    """One trainer against one engine: its own routers' agreement with vLLM's sets, the
    token-layers replay ran with vLLM's exact experts, the KLs per sampled token."""

    engine: str
    trainer: str
    agree: int = 0
    total: int = 0
    exact: int = 0
    kl_live: list[float] = field(default_factory=list)
    kl_replay: list[float] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)  # replayed, per request

    @property
    def agreement(self) -> float:
        return self.agree / self.total

    @property
    def replayed_exactly(self) -> bool:
        return self.exact == self.total

    def add(self, own: torch.Tensor, ran: torch.Tensor, engine_ids: torch.Tensor) -> None:
        """`own` and `ran` `[N, L, K]`: the trainer's choice and what it ran replaying."""
        want = engine_ids.reshape(-1, TINY.top_k)
        self.agree += int(same_sets(own.reshape(-1, TINY.top_k), want).sum())
        self.exact += int(same_sets(ran.reshape(-1, TINY.top_k), want).sum())
        self.total += want.shape[0]

    def line(self) -> str:
        live, replay = float(np.mean(self.kl_live)), float(np.mean(self.kl_replay))
        return (
            f"{self.engine:>6}  {self.trainer:<16}{self.agreement:>10.2%}"
            f"{'yes' if self.replayed_exactly else 'NO':>10}"
            f"{live:>14.3e}{replay:>14.3e}{replay / live:>8.2f}x"
        )


HEADER = (
    f"{'vLLM':>6}  {'trainer':<16}{'agreement':>10}{'replayed':>10}"
    f"{'KL without':>14}{'KL with R3':>14}{'ratio':>9}"
)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, VOCAB, int(n))] for n in rng.integers(6, 20, count)]


def serve(path: Path, dtype: str, asked: list[list[int]], new_tokens: int) -> list[Request]:
    """vLLM samples `asked` (whole-vocabulary logprobs) while its capturer records."""
    llm = engine(path, dtype, max_logprobs=VOCAB)
    with capturing(llm) as capture:
        sampled = sample(llm, asked, new_tokens)
    requests = []
    for s in sampled:
        routes = capture.routes(s.request_id, len(s.tokens))[:, TINY.moe_layers]
        requests.append(Request(s, routes.astype(np.int64)))
    del llm
    return requests


def through_r3store(client: Client, namespace: str, requests: list[Request]) -> None:
    """vLLM's routes put as its `routed_experts` (with the token ids); each put's ref
    kept and resolved as a trainer reads them."""
    client.create_namespace(namespace, SPEC)
    writes = [
        from_vllm(
            f"{namespace}-{i}",
            r.routes.astype(np.uint8),  # vLLM's dtype up to 256 experts
            len(r.sampled.tokens),
            token_ids=np.asarray(r.sampled.tokens, dtype=np.int32),
        )
        for i, r in enumerate(requests)
    ]
    for request, result in zip(requests, client.put(namespace, writes), strict=True):
        request.ref = result.ref
    reader = TrainerReader(client, namespace)
    for request in requests:
        assert request.ref is not None
        resolved = reader.fetch([request.ref])
        assert isinstance(resolved, CompactRoutes)
        request.resolved = resolved


def kl(engine_logp: np.ndarray, trainer_logits: torch.Tensor) -> list[float]:
    """KL(vLLM || trainer) per position, over the whole vocabulary, in fp64."""
    p = torch.from_numpy(engine_logp).double()
    q = torch.log_softmax(trainer_logits.double(), dim=-1)
    return (p.exp() * (p - q)).sum(-1).tolist()


def hf_trainer(hf: Any, dtype: str, requests: list[Request], engine_dtype: str) -> Figures:
    """The HF model in `dtype`, with its own routers and replaying the resolved routes."""
    model = copy.deepcopy(hf).to(DTYPES[dtype]).eval()
    replayer = RouterReplay(model, SPEC)
    figures = Figures(engine_dtype, f"HF {dtype}")
    for r in requests:
        n = len(r.sampled.tokens)
        with torch.no_grad(), replayer.record() as live:
            logits = model(input_ids=r.batch).logits[0]
        used: list[torch.Tensor] = []  # the experts each router hands its MoE block
        hooks = [
            router.register_forward_hook(lambda _m, _i, out, keep=used.append: keep(out[2].clone()))
            for router in replayer.routers
        ]
        assert r.resolved is not None
        try:
            with torch.no_grad(), replayer.replay(r.resolved):
                replayed = model(input_ids=r.batch).logits[0]
        finally:
            for hook in hooks:
                hook.remove()
        ran = torch.stack(used, dim=1)[: n - 1]
        figures.add(live.ids[0, : n - 1], ran, torch.from_numpy(r.routes))
        figures.kl_live += kl(r.sampled.logprobs, logits[r.scored])
        figures.kl_replay += kl(r.sampled.logprobs, replayed[r.scored])
        figures.logprobs.append(torch.log_softmax(replayed[r.scored].double(), -1))
    return figures


def megatron_gpt(hf: Any, dtype: str) -> Any:
    """A Megatron-Core `GPTModel` of the HF Qwen3-MoE's architecture (local layers,
    RMSNorm, QK-norm, grouped-query attention, rotary positions, SwiGLU experts, softmax
    top-k router renormalised) holding its weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.nn.functional import silu

    from megatron_world import REPLAY_ON_CPU

    c = hf.config
    assert c.norm_topk_prob  # Megatron's softmax over the top-k logits is the same
    config = TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim,
        ffn_hidden_size=c.intermediate_size,
        moe_ffn_hidden_size=c.moe_intermediate_size,
        num_moe_experts=c.num_experts,
        moe_router_topk=c.num_experts_per_tok,
        moe_router_pre_softmax=False,
        normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps,
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=silu,
        add_qkv_bias=False,
        **REPLAY_ON_CPU,
        params_dtype=DTYPES[dtype],
        bf16=dtype == "bf16",
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    model = GPTModel(
        config,
        spec,
        vocab_size=c.vocab_size,
        max_sequence_length=c.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(c.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=False,
    )
    missing, unexpected = model.load_state_dict(megatron_weights(hf), strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith("_extra_state") for k in missing), missing
    return model.to(DTYPES[dtype]).eval()


def megatron_weights(hf: Any) -> dict[str, torch.Tensor]:
    """The HF state dict under Megatron's names; the query, key and value projections
    interleaved per query group as Megatron's fused `linear_qkv` holds them."""
    c = hf.config
    w = {k: v.detach().float() for k, v in hf.state_dict().items()}
    groups, d = c.num_key_value_heads, c.head_dim
    out = {
        "embedding.word_embeddings.weight": w["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": w["model.norm.weight"],
        "output_layer.weight": w["lm_head.weight"],
    }
    for i in range(c.num_hidden_layers):
        hf_l, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = w[hf_l + "self_attn.q_proj.weight"].reshape(groups, -1, c.hidden_size)
        k = w[hf_l + "self_attn.k_proj.weight"].reshape(groups, d, c.hidden_size)
        v = w[hf_l + "self_attn.v_proj.weight"].reshape(groups, d, c.hidden_size)
        out |= {
            mg + "input_layernorm.weight": w[hf_l + "input_layernorm.weight"],
            mg + "self_attention.linear_qkv.weight": torch.cat([q, k, v], 1).flatten(0, 1),
            mg + "self_attention.q_layernorm.weight": w[hf_l + "self_attn.q_norm.weight"],
            mg + "self_attention.k_layernorm.weight": w[hf_l + "self_attn.k_norm.weight"],
            mg + "self_attention.linear_proj.weight": w[hf_l + "self_attn.o_proj.weight"],
            mg + "pre_mlp_layernorm.weight": w[hf_l + "post_attention_layernorm.weight"],
            mg + "mlp.router.weight": w[hf_l + "mlp.gate.weight"],
        }
        gate_up, down = w[hf_l + "mlp.experts.gate_up_proj"], w[hf_l + "mlp.experts.down_proj"]
        for e in range(c.num_experts):  # [gate; up] is Megatron's gated fc1 too
            expert = f"{mg}mlp.experts.local_experts.{e}."
            out[expert + "linear_fc1.weight"] = gate_up[e]
            out[expert + "linear_fc2.weight"] = down[e]
    return out


def megatron_trainer(hf: Any, dtype: str, requests: list[Request], engine_dtype: str) -> Figures:
    """Megatron-Core from the HF weights in `dtype`, with its own routers and replaying
    the resolved routes through `MegatronReplay`; every router's routing map is held
    against vLLM's experts. Needs Megatron's parallel state (`megatron_world`)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_world import causal_mask
    from r3store_client.megatron import MegatronReplay, TokenLayout

    model = megatron_gpt(hf, dtype)
    replay = MegatronReplay(model, SPEC)
    maps: list[torch.Tensor] = []  # each router's routing map [N, E], in layer order
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    figures = Figures(engine_dtype, f"Megatron {dtype}")

    def forward(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[T, V]` and the experts each layer ran `[T, L, K]` (sorted)."""
        maps.clear()
        n = batch.shape[1]
        logits = model(batch, torch.arange(n)[None], causal_mask(n))[0]
        ran = torch.stack([m.nonzero()[:, 1].reshape(n, TINY.top_k) for m in maps], 1)
        return logits, ran

    try:
        for r in requests:
            n = len(r.sampled.tokens)
            assert r.resolved is not None
            with torch.no_grad():
                logits, own = forward(r.batch)
                with replay.micro_batch(r.resolved, TokenLayout.sbhd([n], seq_len=n)):
                    replayed, ran = forward(r.batch)
            figures.add(own[: n - 1], ran[: n - 1], torch.from_numpy(r.routes))
            figures.kl_live += kl(r.sampled.logprobs, logits[r.scored])
            figures.kl_replay += kl(r.sampled.logprobs, replayed[r.scored])
            figures.logprobs.append(torch.log_softmax(replayed[r.scored].double(), -1))
    finally:
        for hook in hooks:
            hook.remove()
        replay.detach()
    return figures


def run(
    workdir: Path,
    count: int = 8,
    new_tokens: int = 24,
    engines: tuple[str, ...] = ("fp32", "bf16"),
    trainers: tuple[str, ...] = ("fp32", "bf16"),
    megatron: bool = True,
    init_std: float = 0.3,
) -> list[Figures]:
    """The whole comparison: per vLLM dtype, every trainer's figures."""
    hf = build(TINY, workdir / "model", init_std=init_std)
    asked = prompts(count)
    served = {
        dtype: serve(
            workdir / "model", {"fp32": "float32", "bf16": "bfloat16"}[dtype], asked, new_tokens
        )
        for dtype in engines
    }
    server, url = start_server(workdir / "store")
    try:
        with Client(url) as client:
            for dtype, requests in served.items():
                through_r3store(client, f"vllm-{dtype}", requests)
    finally:
        stop_server(server)
    out = [
        hf_trainer(hf, trainer, requests, dtype)
        for dtype, requests in served.items()
        for trainer in trainers
    ]
    if megatron:
        import torch.distributed as dist
        from vllm.distributed import cleanup_dist_env_and_memory

        from megatron_world import cpu_shims, world

        if dist.is_initialized():  # vLLM's group of one, left by an engine still alive
            cleanup_dist_env_and_memory()
        with cpu_shims(), world():
            out += [
                megatron_trainer(hf, trainer, requests, dtype)
                for dtype, requests in served.items()
                for trainer in trainers
            ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--init-std", type=float, default=0.3)
    parser.add_argument("--no-megatron", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="vllm-r3-") as tmp:
        figures = run(
            Path(tmp),
            args.prompts,
            args.new_tokens,
            megatron=not args.no_megatron,
            init_std=args.init_std,
        )
    tokens = len(figures[0].kl_live)
    print(
        f"\n{TINY.name}: {len(TINY.moe_layers)} MoE layers, {TINY.num_experts} experts, "
        f"top-{TINY.top_k}; {args.prompts} prompts, {tokens} sampled tokens per engine"
    )
    print("agreement: the trainer's own routers pick vLLM's expert set (MoE token-layers)")
    print("replayed: every MoE layer ran exactly vLLM's experts under replay")
    print("KL: mean KL(vLLM || trainer) over the vocabulary at each sampled token\n")
    print(HEADER)
    for f in figures:
        print(f.line())
    for line in megatron_against_hf(figures):
        print(line)


def megatron_against_hf(figures: list[Figures]) -> list[str]:
    """Per engine and trainer dtype: how far Megatron's replayed next-token
    distributions are from HF's (the same weights, the same routes)."""
    by = {(f.engine, f.trainer): f for f in figures}
    out = []
    for engine_dtype, dtype in ((e, t) for e in DTYPES for t in DTYPES):
        hf_f, mg_f = (
            by.get((engine_dtype, f"HF {dtype}")),
            by.get((engine_dtype, f"Megatron {dtype}")),
        )
        if hf_f and mg_f:
            hf_lp, mg_lp = torch.cat(hf_f.logprobs), torch.cat(mg_f.logprobs)
            between = float((hf_lp.exp() * (hf_lp - mg_lp)).sum(-1).mean())
            out.append(
                f"vLLM {engine_dtype}, replayed in {dtype}: mean KL(HF || Megatron) {between:.2e}"
            )
    return out


if __name__ == "__main__":
    main()
