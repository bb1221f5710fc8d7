"""The metrics endpoints of a job started by `recover run --metrics-port`, and how Prometheus
finds them.

Every process of the local job (each controller, each agent) serves its own `/metrics`.
With a fixed base port they take consecutive ports (controllers first, then agents), so a
static scrape configuration can name them; with 0 each takes a free port and says which in
a port file. Either way the launcher prints the addresses, puts them in `summary.json`
(`metrics`) and writes `OUT/prometheus-targets.json` in the format of Prometheus'
`file_sd_configs`, which Prometheus re-reads when it changes: point a scrape job at that
file (deploy/prometheus/recover.yml does) and each new run is scraped without a reload.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TARGETS_FILE = "prometheus-targets.json"
"""Under --out while the job runs: its endpoints, one file_sd target group per process."""


@dataclass(frozen=True)
class MetricsPorts:
    """Where a local job's processes serve metrics."""
    out: Path
    """The run's --out folder (port files, the targets file)."""
    base: int
    """--metrics-port: the first of consecutive ports, or 0 for free ports."""
    controllers: int
    """How many controllers the job has (they come first)."""

    def port_file(self, name: str) -> Path:
        return self.out / f"{name}.metrics-port"

    def flags(self, name: str, index: int) -> list[str]:
        """The metrics flags of process `name`, the `index`-th of the job (controllers
        first): its port, and the file it writes the bound port to."""
        port = self.base + index if self.base else 0
        self.port_file(name).unlink(missing_ok=True)
        return ["--metrics-port", str(port), "--metrics-port-file", str(self.port_file(name))]

    def agent_index(self, agent: int) -> int:
        return self.controllers + agent


def endpoint(port: int, tls: bool) -> str:
    """The URL of a local process's metrics (controllers serve HTTPS under --tls)."""
    return f"{'https' if tls else 'http'}://127.0.0.1:{port}/metrics"


def write_targets(out: Path, job_id: str, endpoints: dict[str, str]) -> Path:
    """OUT/prometheus-targets.json: one target group per process, labelled with the job and
    the process (`recover_job`, `recover_process`) and its scheme. Written atomically:
    Prometheus may read it at any moment."""
    groups = []
    for name, url in endpoints.items():
        scheme, rest = url.split("://", 1)
        groups.append({"targets": [rest.split("/", 1)[0]],
                       "labels": {"recover_job": job_id, "recover_process": name,
                                  "__scheme__": scheme}})
    target = out / TARGETS_FILE
    tmp = target.with_name(f".{TARGETS_FILE}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, target)
    return target
