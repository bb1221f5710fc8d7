"""deploy/systemd: the units pass `systemd-analyze verify` (the real tool: it parses every
setting and checks that each command exists and is executable).

The units name the install location /opt/recover; the check runs them against this
checkout instead (the same files with that one path replaced)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")
    recover = shutil.which("recover") or str(REPO / ".venv" / "bin" / "recover")
    names = []
    for unit in sorted(UNITS.glob("*.service")):
        text = unit.read_text()
        assert "/opt/recover/" in text, unit.name
        text = text.replace("/opt/recover/.venv/bin/recover", recover)
        text = text.replace("/opt/recover/", f"{REPO}/")
        # A template is verified as one of its instances.
        name = unit.name.replace("@.service", "@m1.service")
        (tmp_path / name).write_text(text)
        names.append(name)
    assert names == ["recover-agent.service", "recover-controller.service",
                     "recover-etcd@m1.service", "recover-relay.service"]
    result = subprocess.run([analyze, "verify", *(f"./{n}" for n in names)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    # Unknown or misplaced settings are only warnings to systemd: any output fails the check.
    assert result.returncode == 0 and not (result.stdout + result.stderr).strip(), \
        result.stdout + result.stderr
