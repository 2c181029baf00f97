"""The size budget `make lint` enforces (tools/size_budget.py): it refuses a module over
the limit unless listed with a reason, a list too long, and a listed module back under."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _findings(root: Path) -> list[str]:
    spec = importlib.util.spec_from_file_location("size_budget", ROOT / "tools/size_budget.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found: list[str] = module.findings(root)
    return found


def _tree(root: Path, allowed: str, sizes: dict[str, int]) -> Path:
    root.mkdir(parents=True)
    (root / "pyproject.toml").write_text(
        "[tool.r3store.size-budget]\nmax-lines = 10\nmax-allowed = 1\n"
        f"[tool.r3store.size-budget.allowed]\n{allowed}\n"
    )
    for name, lines in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x = 1\n" * lines)
    return root


def test_the_project_keeps_its_budget() -> None:
    assert _findings(ROOT) == []


def test_a_module_over_the_limit_is_refused_unless_listed(tmp_path: Path) -> None:
    sizes = {"r3store/big.py": 11, "client/r3store_client/ok.py": 10}
    assert _findings(_tree(tmp_path / "a", "", sizes)) == [
        "r3store/big.py: 11 lines, over the limit of 10"
    ]
    listed = '"r3store/big.py" = "one state machine"'
    assert _findings(_tree(tmp_path / "b", listed, sizes)) == []


def test_the_list_is_short_and_says_why(tmp_path: Path) -> None:
    sizes = {"r3store/big.py": 11, "server/r3store_server/huge.py": 12}
    two = '"r3store/big.py" = "why"\n"server/r3store_server/huge.py" = "why"'
    assert _findings(_tree(tmp_path / "a", two, sizes)) == [
        "2 modules allowed past the limit, at most 1"
    ]
    unexplained = '"r3store/big.py" = " "'
    assert "r3store/big.py: allowed past the limit without a reason" in _findings(
        _tree(tmp_path / "b", unexplained, sizes)
    )
    back_under = '"client/r3store_client/ok.py" = "why"'
    found = _findings(_tree(tmp_path / "c", back_under, {"client/r3store_client/ok.py": 3}))
    assert found == [
        "client/r3store_client/ok.py: listed as allowed past the limit, but has 3 lines"
    ]
