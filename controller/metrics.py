"""Prometheus metrics of the controller, read from the coordinator at scrape time.

Pull-based on purpose: nothing is counted on the training path; a scrape
walks the coordinator's state. Names (all prefixed `recover_`):

| metric | type | meaning |
|---|---|---|
| `recover_live_replicas` | gauge | replicas alive in the job |
| `recover_target_replicas` | gauge | replicas the job asks for (`--replicas`; spares not counted) |
| `recover_live_agents` | gauge | agents with a live session |
| `recover_relays` | gauge | rack relays whose streams the leader holds (README "Relays for large jobs") |
| `recover_agents_via_relays` | gauge | agents whose sessions a relay carries |
| `recover_generation` | gauge | current membership generation |
| `recover_steps_committed_total` | counter | committed steps |
| `recover_microbatches_committed_total` | counter | microbatches in committed steps |
| `recover_tokens_committed_total` | counter | tokens in committed steps |
| `recover_tokens_per_second` | gauge | tokens/s over the last 10 committed steps |
| `recover_microbatches_planned` | gauge, by replica | microbatches per replica in the current plan (quota) |
| `recover_microbatch_seconds` | gauge, by replica | measured seconds per microbatch (median of 5 steps) |
| `recover_lead_seconds` | gauge, by replica | seconds from a commit to its next microbatch (median of 5) |
| `recover_steals_total` | counter | work-stealing: steals that moved microbatches |
| `recover_microbatches_stolen_total` | counter | work-stealing: microbatches they moved |
| `recover_failures_total` | counter, by cause | replica failures (injected, external, watchdog, agent-lost) |
| `recover_recoveries_total` | counter | generations made to recover from failures |
| `recover_recovery_seconds` | histogram, by phase | detect, plan, rebuild, recompute, commit |
| `recover_heartbeat_age_seconds` | gauge, by agent | time since the agent was last heard |
| `recover_fenced_messages_total` | counter | stale reports refused (older generation or step) |
| `recover_exact_redos_total` | counter | steps redone after an exact-reduction overflow |
| `recover_leader_term` | gauge | leadership term of the leading controller (1 for the first leader) |
| `recover_controller_is_leader` | gauge | 1 on the leading controller, 0 on a standby (every controller) |
| `recover_controller_fenced_writes_total` | counter | store writes refused: no longer the leader |
| `recover_rendezvous_resets_total` | counter | rendezvous stores reset at their memory or key bound |
| `recover_job_state` | gauge, by state | 1 for the job's current state |
| `recover_joining_replicas` | gauge | replicas joining (transferring state or catching up) |
| `recover_live_spares` | gauge | hot spares: caught up, waiting for a member's place |
| `recover_joins_total` | counter | replicas that joined the running job (spares promoted included) |
| `recover_joins_abandoned_total` | counter | joins given up after their attempts |
| `recover_state_transfer_seconds` | histogram | time to transfer a donor's snapshot to a joiner |
| `recover_last_checkpoint_step` | gauge | step of the newest checkpoint written (-1: none) |
| `recover_store_write_seconds` | histogram | store time per write of the records (a put or a transaction) |
| `recover_rejected_total` | counter, by reason | refused registrations, reports and calls (authz.py) |
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from recover.controller.coordinator import Coordinator, JobState
from recover.controller.leader import LeaderElection
from recover.controller.records import STORE_WRITE_BUCKETS
from recover.controller.recoveries import PHASES
from recover.controller.rendezvous import RendezvousHost

RECOVERY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


class ControllerCollector(Collector):
    def __init__(self, coordinator: Coordinator, leader_term: int = 0,
                 relay_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        self._c = coordinator
        self.leader_term = leader_term
        self._relay_counts = relay_counts
        """(relays connected, agents through them): the leader's relay hub says."""

    def collect(self) -> Iterator[Metric]:
        c = self._c
        now = c.now()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield gauge("recover_live_replicas", "Replicas alive in the job",
                    sum(r.alive for r in c.replicas.values()))
        yield gauge("recover_target_replicas", "Replicas the job asks for", c.view.job.replicas)
        yield gauge("recover_live_agents", "Agents with a live session",
                    sum(a.alive for a in c.agents.values()))
        relays, via_relays = self._relay_counts()
        yield gauge("recover_relays", "Rack relays whose streams the leader holds", relays)
        yield gauge("recover_agents_via_relays", "Agents whose sessions a relay carries",
                    via_relays)
        yield gauge("recover_generation", "Current membership generation", c.generation)
        yield CounterMetricFamily("recover_steps_committed", "Committed steps", value=len(c.steps))
        yield CounterMetricFamily("recover_microbatches_committed", "Microbatches in committed steps",
                                  value=sum(s.microbatches for s in c.steps))
        yield CounterMetricFamily("recover_tokens_committed", "Tokens in committed steps",
                                  value=sum(s.tokens for s in c.steps))
        recent = c.steps[-11:]
        rate = 0.0
        if len(recent) >= 2 and recent[-1].committed_at > recent[0].committed_at:
            rate = sum(s.tokens for s in recent[1:]) / (recent[-1].committed_at - recent[0].committed_at)
        yield gauge("recover_tokens_per_second", "Tokens per second over the last 10 steps", rate)
        planned = GaugeMetricFamily("recover_microbatches_planned",
                                    "Microbatches per replica in the current plan", labels=["replica"])
        for replica, ids in sorted(c.plan.items()):
            planned.add_metric([str(replica)], len(ids))
        yield planned
        speeds = GaugeMetricFamily("recover_microbatch_seconds",
                                   "Measured seconds per microbatch (what quota policies plan "
                                   "from)", labels=["replica"])
        for replica, seconds in c.speeds().items():
            speeds.add_metric([str(replica)], seconds)
        yield speeds
        leads = GaugeMetricFamily("recover_lead_seconds",
                                  "Measured seconds from a commit to the replica's next first "
                                  "microbatch (what quota policies plan with)", labels=["replica"])
        for replica, seconds in c.speeds().leads:
            leads.add_metric([str(replica)], seconds)
        yield leads
        yield CounterMetricFamily("recover_steals", "Work-stealing: steals that moved microbatches",
                                  value=c.steals.steals)
        yield CounterMetricFamily("recover_microbatches_stolen",
                                  "Work-stealing: microbatches moved between members in a step",
                                  value=c.steals.stolen)
        failures = CounterMetricFamily("recover_failures", "Replica failures by cause",
                                       labels=["cause"])
        for cause, count in sorted(Counter(f.cause for f in c.failures).items()):
            failures.add_metric([cause], count)
        yield failures
        yield CounterMetricFamily("recover_recoveries", "Recoveries (new generations after failures)",
                                  value=c.recoveries)
        histogram = HistogramMetricFamily("recover_recovery_seconds",
                                          "Recovery time by phase", labels=["phase"])
        for phase in PHASES:
            values = [t[phase] for t in c.recovery.timings if phase in t]
            buckets = [(str(b), sum(v <= b for v in values)) for b in RECOVERY_BUCKETS]
            buckets.append(("+Inf", len(values)))
            histogram.add_metric([phase], buckets, sum_value=sum(values))
        yield histogram
        ages = GaugeMetricFamily("recover_heartbeat_age_seconds", "Seconds since an agent was heard",
                                 labels=["agent"])
        for agent in c.agents.values():
            if agent.alive:
                ages.add_metric([agent.agent_id], now - c.heartbeats.get(agent.agent_id, now))
        yield ages
        yield CounterMetricFamily("recover_fenced_messages", "Stale reports refused",
                                  value=c.stale_reports)
        yield CounterMetricFamily("recover_exact_redos", "Steps redone after an exact overflow",
                                  value=c.redos)
        yield gauge("recover_leader_term", "Leadership term (0: single controller)", self.leader_term)
        joins = c.joins
        spares = joins.spares
        yield gauge("recover_joining_replicas", "Replicas joining the running job",
                    len(joins.joins) - len(spares))
        yield gauge("recover_live_spares", "Hot spares caught up", len(spares))
        yield CounterMetricFamily("recover_joins", "Replicas that joined the running job",
                                  value=joins.joined)
        yield CounterMetricFamily("recover_joins_abandoned", "Joins given up", value=joins.abandoned)
        seconds = [s for _, s in joins.transfers]
        transfer = HistogramMetricFamily("recover_state_transfer_seconds",
                                         "Snapshot transfer time from donor to joiner")
        transfer.add_metric([], [(str(b), sum(v <= b for v in seconds)) for b in TRANSFER_BUCKETS]
                            + [("+Inf", len(seconds))], sum_value=sum(seconds))
        yield transfer
        writes = c.records.write_latency
        store = HistogramMetricFamily("recover_store_write_seconds",
                                      "Store time per write of the job's records")
        store.add_metric([], [*zip(map(str, STORE_WRITE_BUCKETS), writes.buckets, strict=True),
                              ("+Inf", writes.count)], sum_value=writes.total_s)
        yield store
        yield gauge("recover_last_checkpoint_step", "Step of the newest checkpoint written",
                    c.last_checkpoint.step if c.last_checkpoint is not None else -1)
        rejected = CounterMetricFamily("recover_rejected", "Refused messages and calls by reason",
                                       labels=["reason"])
        for reason, count in sorted(c.rejected.items()):
            rejected.add_metric([str(reason)], count)
        yield rejected
        state = GaugeMetricFamily("recover_job_state", "1 for the job's current state",
                                  labels=["state"])
        for value in JobState:
            state.add_metric([str(value)], 1.0 if c.state is value else 0.0)
        yield state


class RoleCollector(Collector):
    """What every controller exports, leading or standing by."""

    def __init__(self, election: LeaderElection, rendezvous: RendezvousHost | None = None) -> None:
        self._election = election
        self._rendezvous = rendezvous

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("recover_controller_is_leader", "1 while this controller leads",
                                value=1.0 if self._election.holds() else 0.0)
        yield CounterMetricFamily("recover_controller_fenced_writes", "Writes refused: not leader",
                                  value=self._election.refused_writes)
        if self._rendezvous is not None:
            # A reset is a store past its memory or key bound: a stranger writing to it, or a
            # very long job's keys (controller/rendezvous_store.py).
            yield CounterMetricFamily("recover_rendezvous_resets",
                                      "Rendezvous stores replaced after reaching a bound",
                                      value=self._rendezvous.resets)
