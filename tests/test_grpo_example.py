"""`examples/grpo_r3.py`, shortened, against a server of its own: the loop's invariants,
not its figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from r3store.testing.service import start_server, stop_server
from r3store_client import Client

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import grpo_r3

TINY = grpo_r3.Config(
    steps=3, pretrain=2, prompts=2, group=4, prompt_len=8, response_len=6, ahead=1
)


@pytest.mark.slow
def test_grpo_loop_replays_every_token_layer_and_honours_versions(tmp_path: Path) -> None:
    check_loop(TINY, tmp_path)


def check_loop(cfg: grpo_r3.Config, tmp_path: Path) -> dict[str, grpo_r3.Arm]:
    """Both arms of `cfg` against a server of their own, and the loop's invariants
    checked: a lease per step committed once, the policy version moved once a step, the
    staleness window kept, agreement rows per trained version, and under replay every
    token-layer run with the engine's experts."""
    process, url = start_server(tmp_path)
    try:
        results = grpo_r3.run_arms(cfg, url, log=lambda _line: None)
        with Client(url) as client:
            info = {arm: client.namespace(r.namespace) for arm, r in results.items()}
            agreement = {arm: client.agreement(r.namespace) for arm, r in results.items()}
            open_leases = {arm: client.leases(r.namespace)[1] for arm, r in results.items()}
    finally:
        stop_server(process)
    assert set(results) == {"R3", "no replay"}
    for arm, result in results.items():
        assert [s.step for s in result.steps] == list(range(cfg.steps))
        # one lease per step, committed once after its optimizer step
        assert result.leases == result.commits == cfg.steps
        assert open_leases[arm] == []  # none left open: each was committed
        # the policy version moved once per step, with the engine's weights
        assert [s.version for s in result.steps] == list(range(cfg.steps))
        assert info[arm].policy_version == cfg.steps
        assert info[arm].settings.max_policy_lag == cfg.ahead
        assert info[arm].settings.max_times_sampled == 1
        for s in result.steps:
            assert s.trajectories == cfg.prompts * cfg.group
            # the engine runs `ahead` steps ahead: data exactly that old, never older
            assert s.oldest == max(0, s.version - cfg.ahead)
            assert 0 <= s.reward <= 1
            assert s.kl >= 0
        # the server's agreement statistics hold a row per version of the data trained
        trained = {s.oldest for s in result.steps}
        assert {v.policy_version for v in agreement[arm].versions} == trained
    for s in results["R3"].steps:
        assert s.used_match == 1.0  # every trained token-layer ran the engine's experts
        assert s.agreement == 1.0  # and the server, from the trainer's uploads, says so
    assert all(v.overall == 1.0 for v in agreement["R3"].versions)
    for arm in results:
        assert info[arm].spec.ordered == (cfg.engine != "vllm")
    return results


@pytest.mark.slow
def test_grpo_example_command_prints_its_table_and_draws_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "grpo.png"
    argv = ["--own-server", "--steps", "2", "--pretrain", "1", "--prompts", "1", "--group", "4"]
    argv += ["--prompt-len", "8", "--response-len", "4", "--plot", str(png)]
    results = grpo_r3.main(argv)
    out = capsys.readouterr().out
    assert "arm R3: 2 leases, 2 commits" in out
    assert "arm no replay: 2 leases, 2 commits" in out
    assert "KL(k3)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(s.agreement == 1.0 for s in results["R3"].steps)
