"""Discrete-event model of a run under failures: ReCoVer vs checkpoint-and-restart.

Work is counted in microbatches. A step sums M microbatches over the alive
replicas: it takes ceil(M / alive) x microbatch_s + overhead_s. Failures are
events (time, slot, return time). What each system does on a failure:

* ReCoVer: every replica stalls for `recover_stall_s` (detect + plan + group
  rebuild); the survivors keep the microbatches they already finished, and the
  dead replica's finished ones are computed again (spread over the survivors);
  the step then completes. A returned slot rejoins after `rejoin_s` (the design's
  rejoin; NOT built yet, so the calibration runs use schedules without returns).
* ckpt-restart: the step in flight and every step since the last checkpoint are
  lost; nothing progresses for `restart_s` (detect, stop, process start, import,
  rendezvous, load); returned slots are used from the next restart on.
  Checkpoints cost `ckpt_write_s` each, on a fixed step interval or Young-Daly.

`calibrate()` replays a measured `bench throughput` run (same schedule, costs
measured in that run) and reports the error of the modelled run lengths;
`main()` refuses to call projections calibrated when that error exceeds
CALIBRATION_TOLERANCE.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Any

from recover.bench.ckpt_policy import young_daly_interval_s
from recover.bench.env import environment, percentile

CALIBRATION_TOLERANCE = 0.15
"""Largest relative error of a modelled run length accepted as calibrated."""


@dataclass(frozen=True)
class Costs:
    """Measured (or, at scale, assumed) costs; seconds."""

    microbatch_s: float
    """One microbatch on one replica (forward + backward + emulated accelerator time)."""
    overhead_s: float
    """Per step on top of the microbatches: allreduce, commit, optimizer."""
    startup_s: float
    """Launch -> first step starts (paid once by both systems)."""
    recover_stall_s: float
    """ReCoVer: failure -> survivors compute again (detect + plan + rebuild)."""
    restart_s: float
    """ckpt-restart: failure -> workers training again (detect + stop + start + load)."""
    ckpt_write_s: float
    """One checkpoint write (training waits for it)."""
    rejoin_s: float = 0.0
    """ReCoVer: a returned slot's state transfer (the design's rejoin; a stall of everyone)."""


@dataclass(frozen=True)
class Job:
    """What is trained."""

    replicas: int
    """Slots (data-parallel replicas) at start."""
    global_microbatches: int
    """M: constant per step."""
    steps: int
    """Steps to train."""


def step_s(costs: Costs, job: Job, alive: int) -> float:
    return math.ceil(job.global_microbatches / alive) * costs.microbatch_s + costs.overhead_s


Failure = tuple[float, int, float | None]
"""(absolute time, slot, absolute return time or None)."""


def step_end_s(job: Job, costs: Costs, t: float, done: float, alive: int) -> float:
    """When the current step commits if nothing fails: the microbatches not yet `done`,
    spread over `alive` replicas, from time `t`."""
    left = job.global_microbatches - done
    return t + math.ceil(left / alive) * costs.microbatch_s + costs.overhead_s


def lose_replica(job: Job, costs: Costs, t: float, at: float, done: float, alive: int
                 ) -> tuple[float, float]:
    """ReCoVer's in-step recovery from a replica lost at `at` (>= t, the step's restart time):
    (time the survivors compute again, microbatches of the step they keep)."""
    left = job.global_microbatches - done
    # Work finished before the failure, minus the dead replica's share of it.
    progressed = min(left, (at - t) / costs.microbatch_s * alive)
    done = min(done + progressed * (alive - 1) / alive, job.global_microbatches - 1)
    return at + costs.recover_stall_s, done


def simulate_recover(job: Job, costs: Costs, failures: list[Failure]) -> float:
    """Time at which the last step commits."""
    t, step, alive = costs.startup_s, 0, job.replicas
    pending = sorted(failures)
    returns: list[float] = []
    done = 0.0  # microbatches of the current step finished by the survivors so far
    while step < job.steps:
        while returns and returns[0] <= t:
            returns.pop(0)
            alive += 1
            t += costs.rejoin_s
        finish = step_end_s(job, costs, t, done, alive)
        if pending and pending[0][0] < finish and alive > 1:
            at, _, back = pending.pop(0)
            t, done = lose_replica(job, costs, t, max(at, t), done, alive)
            alive -= 1
            if back is not None:
                returns = sorted([*returns, back])
            continue
        t, step, done = finish, step + 1, 0.0
    return t


def simulate_ckpt(job: Job, costs: Costs, failures: list[Failure], every_steps: int | None,
                  mtbf_s: float | None, spares: bool = False) -> float:
    """Time at which the last step commits; checkpoints by step interval or Young-Daly.

    spares: a restart brings the job back to full size (a spare host replaces the
    failed one, as at scale); otherwise failed slots return only when repaired.
    """
    t, step, saved, alive = costs.startup_s, 0, 0, job.replicas
    pending = sorted(failures)
    down: list[float] = []  # return times of slots that will come back
    tau = young_daly_interval_s(costs.ckpt_write_s, mtbf_s) if mtbf_s else math.inf
    last_ckpt = t
    while step < job.steps:
        finish = t + step_s(costs, job, alive)
        if pending and pending[0][0] < finish:
            at, _, back = pending.pop(0)
            alive -= 1
            if back is not None:
                down.append(back)
            t = max(at, t) + costs.restart_s
            alive += sum(1 for b in down if b <= t)  # repaired slots join at the restart
            alive = job.replicas if spares else alive
            down = [b for b in down if b > t]
            step, last_ckpt = saved, t
            continue
        t, step = finish, step + 1
        due = (step % every_steps == 0) if every_steps else (t - last_ckpt >= tau or saved == 0)
        if due and step < job.steps:
            t += costs.ckpt_write_s
            saved, last_ckpt = step, t
    return t


def poisson_failures(replicas: int, mtbf_slot_s: float, repair_s: float | None, horizon_s: float,
                     seed: int) -> list[Failure]:
    """Independent exponential failures per slot; a failed slot is back after repair_s."""
    rng = random.Random(seed)
    out: list[Failure] = []
    for slot in range(replicas):
        t = rng.expovariate(1.0 / mtbf_slot_s)
        while t < horizon_s:
            back = None if repair_s is None else t + repair_s
            out.append((t, slot, back))
            if back is None:
                break
            t = back + rng.expovariate(1.0 / mtbf_slot_s)
    return sorted(out)


# ---------------------------------------------------------------- calibration


def _median(values: list[float]) -> float:
    return percentile(values, 50)


def fit_step(timeline: list[list[float]], kills: list[float], replicas: int, m: int,
             startup_commit: float) -> tuple[float, float]:
    """Least-squares (microbatch_s, overhead_s) from step durations at known alive counts."""
    xs, ys = [], []
    for (t0, _), (t1, _) in zip(timeline, timeline[1:], strict=False):
        if any(t0 < k <= t1 for k in kills) or t0 < startup_commit:
            continue  # a step with a failure in it is not a failure-free step
        alive = replicas - sum(1 for k in kills if k <= t0)
        xs.append(math.ceil(m / alive))
        ys.append(t1 - t0)
    if len(set(xs)) < 2:  # one alive count only: no slope to fit, no overhead assumed
        return _median(ys) / xs[0], 0.0
    n, sx, sy = len(xs), sum(xs), sum(ys)
    sxx, sxy = sum(x * x for x in xs), sum(x * y for x, y in zip(xs, ys, strict=True))
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    return slope, max((sy - slope * sx) / n, 0.0)


def calibrate(results: dict[str, Any]) -> dict[str, Any]:
    """Replay a measured `bench throughput` run in the model; costs come from that run."""
    inputs = results["calibration_inputs"]
    job = Job(results["job"]["replicas"], results["job"]["global_microbatches"],
              results["job"]["steps"])
    rec, ck = inputs["recover"], inputs["ckpt-restart"]
    kills = [k for k in rec["kills_s"]]
    mb, overhead = fit_step(rec["commit_timeline"], kills, job.replicas, job.global_microbatches,
                            rec["commit_timeline"][0][0])
    base = Costs(microbatch_s=mb, overhead_s=overhead, startup_s=0.0, recover_stall_s=0.0,
                 restart_s=0.0, ckpt_write_s=_median(ck["write_s"]) if ck["write_s"] else 0.0)
    full = step_s(base, job, job.replicas)
    rec_costs = replace(base, startup_s=rec["commit_timeline"][0][0] - full,
                        recover_stall_s=_median(rec["recovered_s"]) if rec["recovered_s"] else 0.0)
    ck_first = ck["commit_timeline"][0][0]
    restart = [r["restart_s"] - step_s(base, job, r["world"]) for r in ck["restarts"]
               if r["restart_s"] is not None]
    ck_costs = replace(base, startup_s=ck_first - full, restart_s=_median(restart) if restart else 0.0)
    events = results["schedule"]["events"]

    def absolute(first: float) -> list[Failure]:
        return [(first + e["at_s"], e["slot"], None if e["returns_at_s"] is None
                 else first + e["returns_at_s"]) for e in events]

    policy = results["checkpoint_policy"]
    predicted = {
        "recover": simulate_recover(job, rec_costs, absolute(rec["commit_timeline"][0][0])),
        "ckpt-restart": simulate_ckpt(job, ck_costs, absolute(ck_first), policy["every_steps"],
                                      policy["system_mtbf_s"]),
    }
    measured = {"recover": rec["end_s"], "ckpt-restart": ck["end_s"]}
    errors = {k: abs(predicted[k] - measured[k]) / measured[k] for k in measured}
    return {"costs": {"recover": vars(rec_costs), "ckpt-restart": vars(ck_costs)},
            "predicted_end_s": predicted, "measured_end_s": measured,
            "relative_error": errors, "tolerance": CALIBRATION_TOLERANCE,
            "calibrated": all(e <= CALIBRATION_TOLERANCE for e in errors.values())}


# ---------------------------------------------------------------- projections

LLAMA3_SYSTEM_MTBF_S = 54 * 86400 / 419
"""Llama 3 405B: 419 unexpected interruptions in 54 days on 16,384 GPUs (Meta, 2024)."""

SCENARIOS: list[dict[str, Any]] = [
    {"name": "512 GPUs (paper)", "gpus": 512, "gpu_mtbf_s": LLAMA3_SYSTEM_MTBF_S * 16384},
    {"name": "16k GPUs, Llama-3 failure rate", "gpus": 16384,
     "gpu_mtbf_s": LLAMA3_SYSTEM_MTBF_S * 16384},
    {"name": "100k GPUs, a failure every 18 min", "gpus": 98304, "gpu_mtbf_s": 18 * 60 * 98304},
]
ASSUMED = {
    "gpus_per_replica": 64, "microbatches_per_replica": 4, "step_s": 10.0,
    "detect_s": 3.0, "rebuild_s_at_16k": 10.0, "ckpt_write_s": 30.0, "restart_s": 600.0,
    "repair_s": 1800.0, "hours": 24.0, "seeds": 5,
}
"""At-scale costs not measurable on this machine (stated assumptions, see BENCHMARKS.md)."""


@dataclass(frozen=True)
class Scenario:
    """A projected job: what it trains, what things cost, how often a replica fails."""

    job: Job
    costs: Costs
    rebuild_s: float
    """Rebuilding the data-parallel group (paid at recovery and when replicas enter)."""
    replica_mtbf_s: float

    @property
    def ideal_s(self) -> float:
        return self.job.steps * step_s(self.costs, self.job, self.job.replicas)

    def failures(self, seed: int, k: int) -> list[Failure]:
        """Draw k of a projection: the same for every system compared."""
        return poisson_failures(self.job.replicas, self.replica_mtbf_s, ASSUMED["repair_s"],
                                self.ideal_s * 3, seed * 1000 + k)


def scenario(spec: dict[str, Any], rebuild_s: float | None = None) -> Scenario:
    a = ASSUMED
    replicas = spec["gpus"] // a["gpus_per_replica"]
    job = Job(replicas, replicas * a["microbatches_per_replica"],
              int(a["hours"] * 3600 / a["step_s"]))
    mb = a["step_s"] * 0.95 / a["microbatches_per_replica"]
    if rebuild_s is None:
        rebuild_s = 0.5 * a["rebuild_s_at_16k"] + 0.5 * a["rebuild_s_at_16k"] * spec["gpus"] / 16384
    costs = Costs(microbatch_s=mb, overhead_s=a["step_s"] * 0.05, startup_s=0.0,
                  recover_stall_s=a["detect_s"] + rebuild_s, restart_s=a["restart_s"],
                  ckpt_write_s=a["ckpt_write_s"], rejoin_s=rebuild_s)
    return Scenario(job, costs, rebuild_s, spec["gpu_mtbf_s"] / a["gpus_per_replica"])


def project(spec: dict[str, Any], seed: int) -> dict[str, Any]:
    a = ASSUMED
    s = scenario(spec)
    job, costs, replicas, replica_mtbf, ideal = (s.job, s.costs, s.job.replicas,
                                                 s.replica_mtbf_s, s.ideal_s)
    ettr: dict[str, list[float]] = {"recover": [], "ckpt-restart": []}
    count = []
    for k in range(a["seeds"]):
        fails = s.failures(seed, k)
        count.append(sum(1 for f in fails if f[0] < ideal))
        ettr["recover"].append(ideal / simulate_recover(job, costs, fails))
        ettr["ckpt-restart"].append(ideal / simulate_ckpt(job, costs, fails, None,
                                                          replica_mtbf / replicas, spares=True))
    r, c = (sum(v) / len(v) for v in (ettr["recover"], ettr["ckpt-restart"]))
    return {"scenario": spec["name"], "gpus": spec["gpus"], "replicas": replicas,
            "system_mtbf_min": round(replica_mtbf / replicas / 60, 1),
            "failures_per_day": round(sum(count) / len(count) * 86400 / ideal, 1),
            "ettr_recover": round(r, 4), "ettr_ckpt_restart": round(c, 4),
            "effective_throughput_ratio": round(r / c, 3)}


def main(calibration_source: dict[str, Any] | None, seed: int) -> dict[str, Any]:
    calibration = calibrate(calibration_source) if calibration_source else None
    return {"benchmark": "simulate", "environment": environment(), "calibration": calibration,
            "calibrated": bool(calibration and calibration["calibrated"]),
            "assumptions": ASSUMED, "projections": [project(s, seed) for s in SCENARIOS]}


def format_table(results: dict[str, Any]) -> str:
    rows = []
    cal = results["calibration"]
    if cal is None:
        rows.append("calibration: none given (--calibrate RESULTS): projections are UNCALIBRATED")
    else:
        for k, err in cal["relative_error"].items():
            rows.append(f"calibration {k}: predicted {cal['predicted_end_s'][k]:.1f}s, measured "
                        f"{cal['measured_end_s'][k]:.1f}s, error {err:.1%} "
                        f"(tolerance {cal['tolerance']:.0%})")
        if not cal["calibrated"]:
            rows.append("calibration FAILED: projections below are not to be trusted")
    rows.append(f"{'scenario':<36}{'replicas':>9}{'MTBF min':>10}{'ETTR ReCoVer':>14}"
                f"{'ETTR ckpt':>11}{'ratio':>7}")
    for p in results["projections"]:
        rows.append(f"{p['scenario']:<36}{p['replicas']:>9}{p['system_mtbf_min']:>10}"
                    f"{p['ettr_recover']:>14.3f}{p['ettr_ckpt_restart']:>11.3f}"
                    f"{p['effective_throughput_ratio']:>7.2f}")
    return "\n".join(rows)
