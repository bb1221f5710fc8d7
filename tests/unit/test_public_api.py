"""The public API is `recover.trainer` and nothing else: examples and workloads use only it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import recover.trainer as rt

REPO = Path(__file__).resolve().parents[2]
USERS = sorted([*REPO.glob("examples/*.py"), *REPO.glob("workloads/**/*.py")])


def test_every_export_resolves() -> None:
    assert sorted(rt.__all__) == sorted(rt._EXPORTS)
    for name in rt.__all__:
        assert getattr(rt, name) is not None


@pytest.mark.parametrize("path", USERS, ids=lambda p: str(p.relative_to(REPO)))
def test_user_code_imports_only_the_public_api(path: Path) -> None:
    tree = ast.parse(path.read_text())
    own = "recover.workloads." + path.parent.name if path.parent.parent.name == "workloads" else ""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recover"):
            module = node.module or ""
            assert module == "recover.trainer" or (own and module.startswith(own)), \
                f"{path.name} imports {module}"
            if module == "recover.trainer":
                assert {a.name for a in node.names} <= set(rt.__all__)
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("recover"):
                    assert alias.name == "recover.trainer", f"{path.name} imports {alias.name}"
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "rt":
            assert node.attr in rt.__all__, f"{path.name} uses rt.{node.attr}"


def test_the_command_line_tools_do_not_pay_for_torch() -> None:
    code = "import sys, recover.trainer, recover.trainer.faults; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
