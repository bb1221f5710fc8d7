"""What a `recover bench controller` run's measurements mean (pure): the CPU fit, each
kill's reaction from the clients' receipts, the table."""

from __future__ import annotations

import statistics
from typing import Any


def cpu_fit(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares CPU = fixed + per_agent x N over (N, CPU fraction) points (pure).

    With one point the fixed part is taken as 0 (an upper bound on the slope).
    """
    if not points:
        return None
    if len({n for n, _ in points}) < 2:
        n, cpu = points[0]
        return 0.0, cpu / n
    mean_n = statistics.fmean(n for n, _ in points)
    mean_c = statistics.fmean(c for _, c in points)
    slope = sum((n - mean_n) * (c - mean_c) for n, c in points) / sum(
        (n - mean_n) ** 2 for n, _ in points)
    return mean_c - slope * mean_n, slope


def agents_per_core(fit: tuple[float, float]) -> int | None:
    """Agents at 1 Hz that fill one core, by the fit (pure); None if CPU does not grow."""
    fixed, slope = fit
    return int((1.0 - fixed) / slope) if slope > 0 else None


def plan_receipts(per_agent: list[dict[str, float]], killed_at: float, newest: int,
                  before: int = 1) -> list[float]:
    """Sorted times at which each survivor first received a generation made after the death (pure).

    Only generations after `before` (the generation the death happened in) and up to
    `newest` (the controller's generation once the death was answered) count: the next kill,
    and stopping the agents, make more generations, which must not be mistaken for the plan
    that followed this death.
    """
    firsts = []
    for received in per_agent:
        times = [t for g, t in received.items() if before < int(g) <= newest and t >= killed_at]
        if times:
            firsts.append(min(times))
    return sorted(firsts)


def reactions(outputs: list[dict[str, Any]], generations: list[int | None]
              ) -> list[dict[str, Any]]:
    """Each kill's reaction (pure): kill `i` went to client `i % len(outputs)` (its own
    `i // len(outputs)`-th kill, None if it had no live agent left) and was answered by
    generation `generations[i]` (None: not answered in time, a row of its own, never left out);
    the time from it to the first and the last survivor holding a plan made after it, and the
    last of each kind of client (`racks`: as the leader's stream delivered it to a simulated
    rack; `agents`: as the agent's own session, direct or through a real relay, did)."""
    rows: list[dict[str, Any]] = []
    before = 1
    for i, newest in enumerate(generations):
        kills = outputs[i % len(outputs)]["kills_at"]
        killed_at = kills[i // len(outputs)] if i // len(outputs) < len(kills) else None
        if killed_at is None:
            continue  # that client had no live agent left to kill
        if newest is None:
            rows.append({"first_s": None, "last_s": None, "last_by_kind_s": {},
                         "survivors": 0, "generation": None, "unanswered": True})
            continue
        last_by_kind: dict[str, float] = {}
        received = []
        for out in outputs:
            after = plan_receipts(out["generations"], killed_at, newest, before)
            received += after
            if after:
                kind = out.get("kind", "agents")
                last_by_kind[kind] = max(last_by_kind.get(kind, 0.0),
                                         round(after[-1] - killed_at, 5))
        received.sort()
        rows.append({"first_s": round(received[0] - killed_at, 5) if received else None,
                     "last_s": round(received[-1] - killed_at, 5) if received else None,
                     "last_by_kind_s": last_by_kind,
                     "survivors": len(received), "generation": newest})
        before = newest
    return rows


def answered_of(row: dict[str, Any]) -> str:
    """Kills answered, and of how many if some were not (pure)."""
    kills = row.get("kills", [])
    unanswered = sum(1 for k in kills if k.get("unanswered"))
    return f"{len(kills) - unanswered}/{len(kills)}" if unanswered else str(len(kills))


def format_table(results: dict[str, Any]) -> str:
    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1000:.1f}ms"

    lines = [f"{'agents':>6} {'up s':>6} {'CPU %':>6} {'reg p99':>9} {'probe p50':>10} "
             f"{'p99':>8} {'kills':>5} {'death->plan first p50':>21} {'last p50':>9} "
             f"{'last p99':>9} {'lost':>5}"]
    for r in results["rows"]:
        if "error" in r:
            lines.append(f"{r['agents']:>6} {r['error']}")
            continue
        lost = r["agents"] - r.get("killed", 1) - r["agents_alive_after_death"]
        lines.append(
            f"{r['agents']:>6} {r['all_up_s']:>6.1f} {r['controller_cpu_fraction'] * 100:>6.1f} "
            f"{ms(r['register_rtt_p99_s']):>9} {ms(r['probe_rtt_p50_s']):>10} "
            f"{ms(r['probe_rtt_p99_s']):>8} {answered_of(r):>5} "
            f"{ms(r.get('death_to_first_plan_p50_s')):>21} "
            f"{ms(r.get('death_to_last_plan_p50_s')):>9} "
            f"{ms(r.get('death_to_last_plan_p99_s')):>9} {lost:>5}")
    if results["cpu_fraction_per_agent"] is not None:
        lines.append(f"fit: CPU = {results['cpu_fixed_fraction'] * 100:.2f}% + N x "
                     f"{results['cpu_fraction_per_agent'] * 1e5:.2f}e-3 %; extrapolated: "
                     f"~{results['agents_per_core_extrapolated']} agents at 1 Hz per controller "
                     "core (one asyncio thread: a controller uses one core at most)")
    return "\n".join(lines)
