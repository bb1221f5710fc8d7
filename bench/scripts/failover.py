"""Leader failover time (crash and clean shutdown) and the etcd store's step-time overhead.

    python bench/scripts/failover.py [--trials 10] [--out runs/bench-failover]

Failover: one etcd, three `recover controller` processes on fixed ports, two
agents (4 replicas) training a long job. Each trial finds the leader, hits it
(SIGKILL or SIGTERM), and measures from the hit until (a) another controller
reports itself leader ("elected") and (b) a step commits after the hit
("resumed": the agents rejoined and the new generation reduced a step). The
hit controller is restarted as a standby before the next trial.

Overhead: the same failure-free job with `--store memory://` and with
`--store etcd://`, run back to back; the ratio of median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from recover.proto import pb, rpc  # noqa: E402
from tests.etcd_cluster import EtcdCluster, free_port  # noqa: E402

PY = [sys.executable, "-m", "recover.cli.main"]
JOB = ["--replicas", "4", "-M", "8", "-B", "2", "--seed", "5"]


def status(port: int) -> pb.JobStatus | None:
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            return rpc.ControlStub(channel).Status(pb.StatusRequest(), timeout=1)
    except grpc.RpcError:
        return None


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fresh(path: Path) -> Path:
    """An empty directory: a rerun into the same --out must not find the last run's etcd
    data (the job's persisted state would make the new controllers take it over)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def failover(out: Path, trials: int) -> dict[str, dict[str, float]]:
    cluster = EtcdCluster(fresh(out / "etcd"), 1).start()
    ports = [free_port() for _ in range(3)]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    logs = fresh(out / "logs")
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def start_controller(i: int) -> None:
        with open(logs / f"controller-{i}.log", "ab") as log:
            procs[i] = subprocess.Popen(
                [*PY, "controller", *JOB, "--steps", "100000", "--job-id", "bench-failover",
                 "--port", str(ports[i]), "--store", cluster.url, "--controller-id", f"c{i}"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    agents = []
    try:
        for i in range(3):
            start_controller(i)
            time.sleep(0.3)
        for a in range(2):
            with open(logs / f"agent-{a}.log", "ab") as log:
                agents.append(subprocess.Popen(
                    [*PY, "agent", "--controller", addresses, "--slots", "2", "--agent-id", f"h{a}",
                     "--log-dir", str(logs), "--connect-timeout", "60"],
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        results: dict[str, dict[str, list[float]]] = {}
        for kind, sig in (("crash (SIGKILL)", signal.SIGKILL), ("clean (SIGTERM)", signal.SIGTERM)):
            elected: list[float] = []
            resumed: list[float] = []
            for _ in range(trials):
                while True:  # a leader that trains, and every standby up
                    states = {i: status(p) for i, p in enumerate(ports)}
                    leader = next((i for i, s in states.items() if s and s.role == "leader"
                                   and s.state == "running" and s.steps_committed > 3), None)
                    if leader is not None and all(states.values()):
                        break
                    time.sleep(0.1)
                committed = states[leader].steps_committed  # type: ignore[union-attr]
                hit = time.monotonic()
                os.kill(procs[leader].pid, sig)
                got_elected = None
                while True:
                    others = [status(p) for i, p in enumerate(ports) if i != leader]
                    now = time.monotonic()
                    new = next((s for s in others if s and s.role == "leader"), None)
                    if new is not None and got_elected is None:
                        got_elected = now - hit
                    if new is not None and new.steps_committed > committed + 1:
                        break
                    if now - hit > 30:
                        raise RuntimeError(f"no takeover within 30s ({kind}); see {logs}")
                    time.sleep(0.01)
                elected.append(got_elected or 0.0)
                resumed.append(time.monotonic() - hit)
                procs[leader].wait(timeout=10)
                start_controller(leader)
                print(f"{kind}: elected {elected[-1]:.3f}s, resumed {resumed[-1]:.3f}s", flush=True)
            results[kind] = {"elected": elected, "resumed": resumed}
        return {kind: {f"{m}_{q}": round(percentile(v, p), 3)
                       for m, v in r.items() for q, p in (("p50", 0.5), ("p99", 0.99))}
                | {"trials": trials} for kind, r in results.items()}
    finally:
        for p in [*procs.values(), *agents]:
            if p.poll() is None:
                p.kill()
                p.wait()
        cluster.stop()


def overhead(out: Path, steps: int, compute_ms: float) -> dict[str, float]:
    cluster = EtcdCluster(fresh(out / "etcd-overhead"), 1).start()
    try:
        medians = {}
        for name, store in (("memory", "memory://"), ("etcd", cluster.url)):
            run = out / f"run-{name}"
            subprocess.run([*PY, "run", *JOB, "--steps", str(steps), "--quiet", "--store", store,
                            "--compute-ms", str(compute_ms), "--out", str(run)],
                           check=True, capture_output=True, timeout=600)
            medians[name] = json.loads((run / "summary.json").read_text())["step_time"]["median_s"]
        return {"compute_ms": compute_ms, "memory_step_s": medians["memory"],
                "etcd_step_s": medians["etcd"],
                "added_ms": round(1000 * (medians["etcd"] - medians["memory"]), 2),
                "ratio": round(medians["etcd"] / medians["memory"], 4)}
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=150, help="steps of each overhead run")
    parser.add_argument("--compute-ms", type=float, default=0.0,
                        help="emulated accelerator time per microbatch in the overhead runs")
    parser.add_argument("--overhead-only", action="store_true", help="skip the failover trials")
    parser.add_argument("--out", default="runs/bench-failover")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, object] = {"overhead": overhead(out, args.steps, args.compute_ms)}
    if not args.overhead_only:
        result["failover"] = failover(out, args.trials)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
