"""Capacity that comes back (issue 13) in the discrete-event model of simulate.py.

As built, a lost replica's slot does not wait for anyone: its worker is
restarted (or its host replaced, after `repair`), the new replica takes the
state from a live donor while the others keep training, catches up on the
committed steps it missed, and enters at a step boundary in a new generation.
The survivors pay only that entry (`entry_s`: the group is rebuilt with it,
once per boundary however many enter). Hot spares are warm replicas outside
the plan that hold every committed step: a loss promotes one into the very
generation that recovers from it (the same group rebuild; it takes the lost
microbatches), and the returned slot becomes a spare in its place. Members
never exceed the job's replicas; what returns beyond that waits as a spare.

Not modelled: an idle spare failing (it would only shrink the pool; with a
handful of spares among thousands of replicas, <1 % more failures) and a join
that fails and is retried.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from recover.bench.simulate import (
    ASSUMED,
    SCENARIOS,
    Costs,
    Failure,
    Job,
    lose_replica,
    scenario,
    simulate_recover,
    step_end_s,
)


@dataclass(frozen=True)
class Elastic:
    """How replicas come back; seconds."""

    spares: int
    """Warm spares at start (provisioned on top of the job's replicas)."""
    join_s: float
    """A returned slot: process start, model build, state transfer and catch-up, all in the
    background (the survivors keep training)."""
    entry_s: float
    """Everyone stalls this long when replicas enter (a new generation rebuilds the group)."""


def simulate_elastic(job: Job, costs: Costs, elastic: Elastic, failures: list[Failure]) -> float:
    """Time at which the last step commits."""
    t, step, alive, spares = costs.startup_s, 0, job.replicas, elastic.spares
    pending = sorted(failures)
    arrivals: list[float] = []  # when a replica (promoted spare or rejoining slot) may enter
    done = 0.0  # microbatches of the current step finished by the survivors so far
    while step < job.steps:
        if done == 0.0:  # a step boundary: who is ready enters, the rest of them wait as spares
            ready = [a for a in arrivals if a <= t]
            arrivals = [a for a in arrivals if a > t]
            entering = min(len(ready), job.replicas - alive)
            spares += len(ready) - entering
            if entering:
                alive += entering
                t += elastic.entry_s
        finish = step_end_s(job, costs, t, done, alive)
        if pending and pending[0][0] < finish and alive > 1:
            at, _, back = pending.pop(0)
            at = max(at, t)
            t, done = lose_replica(job, costs, t, at, done, alive)
            if spares:  # it enters the recovering generation: no second rebuild
                spares -= 1
            else:
                alive -= 1
            if back is not None:
                arrivals.append(back + elastic.join_s)
            continue
        t, step, done = finish, step + 1, 0.0
    return t


ASSUMED_ELASTIC: dict[str, Any] = {"join_s": 90.0, "spare_cover": 2.0,
                                   "restart_fraction": 0.3}
"""At scale (not measurable here): a slot is ready to enter 90 s after it is back (process
start and imports, model build, a transfer of each GPU's shard from its counterpart in a
donor replica, catch-up); spares for twice the slots expected to be down at once (at least
one). A warm spare has applied the last committed step by the time a loss is known (it
gets each step's gradient as the step commits; measured here: promoted at the lost step in
the rejoin benchmark), so it enters the recovery itself.
`restart_fraction`: the failures a process restart on the same host fixes (software, NCCL
timeouts, transient faults; about 22 % of Llama 3's 419 interruptions were not hardware
issues, and some hardware ones, a network link, do not retire the host) - those slots are
back at once; the rest wait for the host's repair or replacement (ASSUMED["repair_s"])."""


def project(spec: dict[str, Any], seed: int, rebuild_s: float | None = None) -> dict[str, Any]:
    """ETTR with the slot back only after repair (simulate.py's model), with rejoin as built,
    and with rejoin and hot spares; same failure draws for all three."""
    a = ASSUMED_ELASTIC
    s = scenario(spec, rebuild_s)
    down = s.job.replicas * ASSUMED["repair_s"] / s.replica_mtbf_s * (1 - a["restart_fraction"])
    spares = max(1, math.ceil(a["spare_cover"] * down))
    variants = {
        "rejoin": Elastic(0, a["join_s"], s.rebuild_s),
        "spares": Elastic(spares, a["join_s"], s.rebuild_s),
    }
    ettr: dict[str, list[float]] = {"repair": [], "rejoin": [], "spares": []}
    for k in range(ASSUMED["seeds"]):
        fails = s.failures(seed, k)
        ettr["repair"].append(s.ideal_s / simulate_recover(s.job, s.costs, fails))
        restarts = random.Random(seed * 1000 + k)
        fails = [(at, slot, at if back is not None and restarts.random() < a["restart_fraction"]
                  else back) for at, slot, back in fails]
        for name, elastic in variants.items():
            ettr[name].append(s.ideal_s / simulate_elastic(s.job, s.costs, elastic, fails))
    mean = {k: sum(v) / len(v) for k, v in ettr.items()}
    provisioned = s.job.replicas / (s.job.replicas + spares)
    return {"scenario": spec["name"], "replicas": s.job.replicas, "spares": spares,
            "rebuild_s": round(s.rebuild_s, 1),
            "ettr_repair_only": round(mean["repair"], 4),
            "ettr_rejoin": round(mean["rejoin"], 4),
            "ettr_rejoin_spares": round(mean["spares"], 4),
            "ettr_rejoin_spares_per_provisioned_gpu": round(mean["spares"] * provisioned, 4)}


def projections(seed: int) -> list[dict[str, Any]]:
    rows = [project(spec, seed) for spec in SCENARIOS]
    # The group rebuild dominates at 100k GPUs; with the cross-replica groups of an HSDP job
    # (one rank per replica per shard, rebuilt in parallel) it may cost what it does at 16k.
    sensitivity = dict(SCENARIOS[-1], name=SCENARIOS[-1]["name"] + ", rebuild as at 16k")
    rows.append(project(sensitivity, seed, rebuild_s=ASSUMED["rebuild_s_at_16k"]))
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'capacity comes back':<54}{'rebuild s':>10}{'spares':>7}{'repair only':>12}"
             f"{'rejoin':>8}{'+spares':>9}{'per GPU':>9}"]
    for r in rows:
        lines.append(f"{r['scenario']:<54}{r['rebuild_s']:>10}{r['spares']:>7}"
                     f"{r['ettr_repair_only']:>12.3f}"
                     f"{r['ettr_rejoin']:>8.3f}{r['ettr_rejoin_spares']:>9.3f}"
                     f"{r['ettr_rejoin_spares_per_provisioned_gpu']:>9.3f}")
    return "\n".join(lines)
