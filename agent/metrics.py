"""Prometheus metrics of an agent, read from its state at scrape time.

| metric | type | meaning |
|---|---|---|
| `recover_agent_workers` | gauge, by state | worker processes (every rank of a replica) running / exited |
| `recover_agent_worker_exits_total` | counter, by cause | crash, watchdog, agent (stopped, sibling lost) |
| `recover_agent_generation` | gauge | newest generation this agent forwarded |
| `recover_agent_heartbeats_total` | counter | heartbeats sent to the controller |
| `recover_agent_leader_term` | gauge | highest controller leadership term seen |
| `recover_agent_fenced_commands_total` | counter | commands refused (a lower term, or an older generation) |
| `recover_agent_reconnects_total` | counter | sessions re-opened with a new leader (workers kept running) |
| `recover_agent_reports_relayed_total` | counter | worker reports relayed upstream |
| `recover_agent_worker_progress_age_seconds` | gauge, by replica, rank | since its last liveness beat |
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from recover.agent.workers import WorkerProcess, every_process
from recover.common import progress
from recover.common.netaddr import write_port_file

log = logging.getLogger("recover.agent")

class AgentReadings(Protocol):
    """What the collector reads of an agent (the daemon's `Agent`), at scrape time."""

    workers: dict[int, WorkerProcess]
    generation: int
    term: int
    fenced_commands: int
    reconnects: int
    heartbeats_sent: int
    reports_relayed: int


class AgentCollector(Collector):
    def __init__(self, agent: AgentReadings) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        workers = every_process(agent.workers)
        running = sum(w.process.returncode is None for w in workers)
        states = GaugeMetricFamily("recover_agent_workers", "Workers by state", labels=["state"])
        states.add_metric(["running"], running)
        states.add_metric(["exited"], len(workers) - running)
        yield states
        exits = CounterMetricFamily("recover_agent_worker_exits", "Worker exits by cause",
                                    labels=["cause"])
        exited = [w for w in workers if w.process.returncode is not None]
        watchdog = sum(w.killed_by_agent.startswith("watchdog") for w in exited)
        crashes = sum(not w.killed_by_agent for w in exited)
        exits.add_metric(["watchdog"], watchdog)
        exits.add_metric(["agent"], len(exited) - watchdog - crashes)
        exits.add_metric(["crash"], crashes)
        yield exits
        yield GaugeMetricFamily("recover_agent_generation", "Newest generation forwarded",
                                value=agent.generation)
        yield GaugeMetricFamily("recover_agent_leader_term", "Highest leader term seen",
                                value=agent.term)
        yield CounterMetricFamily("recover_agent_fenced_commands", "Controller commands refused",
                                  value=agent.fenced_commands)
        yield CounterMetricFamily("recover_agent_reconnects", "Sessions re-opened with a new leader",
                                  value=agent.reconnects)
        yield CounterMetricFamily("recover_agent_heartbeats", "Heartbeats sent",
                                  value=agent.heartbeats_sent)
        yield CounterMetricFamily("recover_agent_reports_relayed", "Worker reports relayed",
                                  value=agent.reports_relayed)
        ages = GaugeMetricFamily("recover_agent_worker_progress_age_seconds",
                                 "Seconds since a worker's last liveness beat",
                                 labels=["replica", "rank"])
        now = time.monotonic()
        for worker in workers:
            snapshot = progress.read(worker.progress_path) if worker.progress_path else None
            if worker.process.returncode is None and snapshot is not None and snapshot.beat_at > 0:
                ages.add_metric([str(worker.replica), str(worker.rank)], now - snapshot.beat_at)
        yield ages


def serve_metrics(readings: AgentReadings, host: str, port: int, port_file: str | None) -> int:
    """Serve `readings` on http://HOST:PORT/metrics (0: any free port); the port it got."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(readings))
    server, _ = start_http_server(port, host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    if port_file:
        write_port_file(port_file, server.server_port)
    return int(server.server_port)
