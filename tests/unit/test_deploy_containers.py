"""deploy/docker and deploy/compose: the compose file validated by the compose tool itself
(`docker-compose config`, Debian's docker-compose, which checks it against the compose
schema without a daemon), every service's command line parsed by `recover`, and the
Dockerfile copying every package the project installs. No image is built here: the test
machine reaches no registry to pull a base image from.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from recover.cli.main import build_parser

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "deploy" / "compose" / "compose.yaml"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def test_the_compose_tool_accepts_the_compose_file() -> None:
    tool = shutil.which("docker-compose")
    if tool is None:
        pytest.skip("docker-compose is not installed (scripts/test.sh installs the Debian "
                    "package)")
    result = subprocess.run([tool, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_service_runs_a_command_recover_accepts() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    parser = build_parser()
    roles = {}
    for name, service in services.items():
        if name == "etcd":
            continue
        assert service["image"] == f"recover:{version()}"
        args = parser.parse_args(service["command"])
        roles[name] = args.command
        if args.command == "agent":
            controllers = [s for s, r in roles.items() if r == "controller"]
            assert args.controller == ",".join(f"{c}:50051" for c in controllers)
        else:
            assert args.host == name and args.store == "etcd://etcd:2379"
    assert sorted(roles.values()) == ["agent", "agent", "controller", "controller"]


def version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_dockerfile_copies_every_package_and_runs_unprivileged() -> None:
    text = DOCKERFILE.read_text()
    copied = set(re.findall(r"^COPY (\w+) /opt/recover/\1$", text, re.MULTILINE))
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = set(tool["package-dir"].values())
    assert installed <= copied, f"not in the image: {installed - copied}"
    assert all((REPO / folder).is_dir() for folder in copied)
    assert re.search(r"^USER recover$", text, re.MULTILINE)
    assert 'ENTRYPOINT ["recover"]' in text
    k8s = "\n".join(p.read_text() for p in (REPO / "deploy" / "k8s").glob("*.yaml"))
    assert set(re.findall(r"image: (recover:\S+)", k8s)) == {f"recover:{version()}"}
