"""Failure-free step time at the demo sizes, and where a step's time goes.

    python bench/scripts/profile_step.py --out /tmp/bench-step [--steps 30] [--profile-steps 300]

Two jobs, both 4 replicas on 2 agents, -M 16 -B 8, default model, no faults:

1. a plain `recover run --steps 30`: its summary.json `step_time` (median over
   failure-free steps of commit-to-commit wall time, the slowest replica's
   compute and reduce, and the rest = control) is the headline number; no
   profiler is attached, so nothing perturbs it;
2. a longer job (`--profile-steps`, default 300, so that the sampler sees a
   few thousand samples of steady state) with py-spy attached to one worker
   (replica 1 by default) and to the controller:

       py-spy record --pid PID --rate 100 --idle --threads --format raw --duration D

   Worker pids come from the controller's "replica-ready" events
   (`recover events --controller 127.0.0.1:PORT --json`, message "pid N, ...",
   PORT from OUT/controller.port while the job runs); the controller's pid is
   the launcher's child running `recover.cli.main controller`. Recording
   starts once the job has started training and stops before it ends.

`--idle` keeps samples of threads blocked in a wait, so waiting (allreduce,
the controller's commit, epoll) shows up as time; the fractions below are
over the *main thread* of each process only (gRPC and timer threads, which
sit idle nearly always, are left out). Each main-thread sample is put in the
first category, in the order listed in WORKER_CATEGORIES / CONTROLLER_CATEGORIES,
whose pattern matches one of its frames (innermost first). The raw collapsed
stacks stay in OUT/ (worker.raw, controller.raw) for flame graphs
(e.g. speedscope.app accepts them, or rerun with --format speedscope).

Caveats: py-spy pauses the target ~100 times a second to read its stack and
itself takes CPU; on a 2-core machine that slows the profiled job a little
(its step_time is reported next to the plain job's). Without --native,
time inside torch's C++ kernels is attributed to the Python line that
called them, which is what we want here.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recover.bench.env import foreign_load, git_revision, machine

# Worker: a sample goes to the category of its OUTERMOST frame that matches one of
# these patterns (so time inside torch under the model's forward is "forward", time
# inside torch.optim under the commit is "optimizer step", and so on). Samples that
# match none fall back to the innermost StepExecutor method they are in.
WORKER_CATEGORIES: list[tuple[str, str]] = [
    ("data: sample ids + corpus + collate",
     r"DatasetMicrobatches\.|EpochSampler\.|SyntheticCorpus\.|default_collate"),
    ("dropout seeding (torch.manual_seed)", r"manual_seed|Workload\.seed_rngs"),
    ("forward", r"TinyGPT\.forward|Module\._wrapped_call_impl"),
    ("backward", r"Tensor\.backward"),
    ("allreduce (gloo, incl. waiting for the slowest peer)", r"GenerationGroup\.allreduce_sum_"),
    ("group connect / abort (rebuild)", r"GenerationGroup\.(connect|abort|close)"),
    ("parameter_digest", r"parameter_digest"),
    ("optimizer step (AdamW)", r"Optimizer\.|torch/optim/"),
    ("grpc/protobuf: sending reports", r"AgentChannel\.(send|note_fault)|SerializeToString"),
    ("waiting for the controller (commit / next plan)", r"AgentChannel\.(next_command|poll)"),
    ("gradient buffer (accumulate / copy / load)", r"Accumulator\.|GradientBuckets\."),
    ("progress beacon", r"ProgressBeacon\."),
]
WORKER_FALLBACKS: list[tuple[str, str]] = [
    ("reduce: other (building the report)", r"StepExecutor\._reduce "),
    ("commit: other (building the report)", r"StepExecutor\._apply_commit "),
    ("compute: other (loss.item, bookkeeping)", r"StepExecutor\._compute"),
    ("generation handling", r"StepExecutor\._(enter_generation|adopt_plan|install_group)"),
]
# Controller: the INNERMOST matching frame decides (so a store write inside a commit
# counts as "store put").
CONTROLLER_CATEGORIES: list[tuple[str, str]] = [
    ("idle: event loop waiting in epoll", r"EpollSelector\.select|selectors\.py"),
    ("store put (durable records)", r"Store\.|controller/store\.py"),
    ("events log", r"EventLog\.|controller/events\.py"),
    ("commit: sample digest / plan check", r"sample_digest|check_plan|uniform_plan|policy\.py"),
    ("commit: record + broadcast", r"Coordinator\._commit|Coordinator\._broadcast"),
    ("coordinator: other report handling (reduced, applied, heartbeat)", r"Coordinator\."),
    ("grpc/protobuf (python side)", r"SerializeToString|FromString|_pb2|grpc/"),
    ("status / events RPCs (the launcher polling)", r"ControlService\.|job_status"),
    ("grpc aio: reading agent streams (cython, incl. protobuf parsing)",
     r"AgentSessions\.Session\.<locals>\.read \(controller/service\.py:1[45][0-9]\)"),
    ("service dispatch / session queues", r"AgentSessions\.|controller/service\.py"),
    ("liveness watch", r"watch_liveness"),
]
CONTROLLER_FALLBACKS: list[tuple[str, str]] = [
    ("asyncio / grpc-aio callbacks (C or cython, no Python frame)", r"Handle\._run|_run_once"),
]


def parse_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's collapsed stacks: 'thread (TID): NAME;outer;...;inner count' per line."""
    stacks = []
    for line in path.read_text().splitlines():
        frames_text, _, count = line.rpartition(" ")
        if frames_text and count.isdigit():
            stacks.append((frames_text.split(";"), int(count)))
    return stacks


def categorize(stacks: list[tuple[list[str], int]], categories: list[tuple[str, str]],
               fallbacks: list[tuple[str, str]], innermost_first: bool) -> dict[str, Any]:
    """Fractions of the main thread's samples per category (see the comments above)."""
    compiled = [(name, re.compile(rx)) for name, rx in categories]
    compiled_fb = [(name, re.compile(rx)) for name, rx in fallbacks]
    counts: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for frames, n in stacks:
        threads[frames[0]] += n
        if not frames[0].endswith(": MainThread"):
            continue
        body = frames[1:]
        leaves[body[-1] if body else "?"] += n
        order = list(reversed(body)) if innermost_first else body
        hit = next((name for frame in order for name, rx in compiled if rx.search(frame)), None)
        if hit is None:
            hit = next((name for frame in reversed(body) for name, rx in compiled_fb
                        if rx.search(frame)), "other")
        counts[hit] += n
    total = sum(counts.values())
    return {
        "samples_main_thread": total,
        "samples_per_thread": dict(threads.most_common()),
        "fractions": {k: round(v / total, 4) for k, v in counts.most_common()} if total else {},
        "top_leaf_frames": [[k, round(v / total, 4)] for k, v in leaves.most_common(15)]
        if total else [],
    }


def run_job(out: Path, steps: int, extra: list[str] | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "recover.cli.main", "run", "--replicas", "4", "--steps", str(steps),
            "-M", "16", "-B", "8", "--seed", "0", "--out", str(out), "--quiet", *(extra or [])]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int | None, str]:
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # `recover run` then stops its whole job
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        return None, output


def events(port: int) -> list[dict[str, Any]]:
    res = subprocess.run([sys.executable, "-m", "recover.cli.main", "events", "--controller",
                          f"127.0.0.1:{port}", "--json"], capture_output=True, text=True, timeout=30)
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def children(pid: int) -> list[tuple[int, str]]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(entry), cmd))
        except (OSError, ValueError, IndexError):
            continue
    return found


def step_time_of(summary: dict[str, Any]) -> dict[str, Any]:
    st = summary.get("step_time") or {}
    per_mb = st.get("compute_s", 0) / (16 / 4) if st else None
    return {"state": summary["state"], "steps_committed": summary["steps_committed"],
            "step_time": st, "compute_per_microbatch_s": round(per_mb, 5) if per_mb else None,
            "train_s": summary["train_s"], "wall_s": summary["wall_s"],
            "train_s_per_step": round(summary["train_s"] / max(summary["steps_committed"], 1), 5)
            if summary.get("train_s") else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=30, help="steps of the plain job (default 30)")
    parser.add_argument("--profile-steps", type=int, default=300,
                        help="steps of the profiled job (default 300)")
    parser.add_argument("--duration", type=int, default=15, help="py-spy seconds (default 15)")
    parser.add_argument("--replica", type=int, default=1, help="worker replica to profile (default 1)")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    args = parser.parse_args()
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        parser.error("py-spy not found: pip install py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    noise_start = foreign_load()
    # 1. plain job: the step time nothing perturbs
    print(f"[1/2] plain job, {args.steps} steps", file=sys.stderr, flush=True)
    rc, output = finish(run_job(out / "plain", args.steps), 170)
    plain_path = out / "plain" / "summary.json"
    plain = step_time_of(json.loads(plain_path.read_text())) if plain_path.exists() else None
    print(f"      rc={rc} {plain}", file=sys.stderr, flush=True)

    # 2. profiled job
    print(f"[2/2] profiled job, {args.profile_steps} steps, py-spy {args.duration}s on replica "
          f"{args.replica} and the controller", file=sys.stderr, flush=True)
    job_dir = out / "profiled"
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "controller.port").unlink(missing_ok=True)
    launcher = run_job(job_dir, args.profile_steps)
    deadline = time.monotonic() + 90
    port_file = job_dir / "controller.port"
    worker_pid = controller_pid = None
    while time.monotonic() < deadline and launcher.poll() is None:
        if port_file.exists() and port_file.read_text().strip():
            evs = events(int(port_file.read_text()))
            if any(e["kind"] == "started" for e in evs):
                for e in evs:
                    if e["kind"] == "replica-ready" and int(e["replica"]) == args.replica:
                        worker_pid = int(re.match(r"pid (\d+)", e["message"]).group(1))
                controller_pid = next((p for p, cmd in children(launcher.pid)
                                       if "recover.cli.main controller" in cmd), None)
                break
        time.sleep(0.3)
    if worker_pid is None or controller_pid is None:
        print("could not find the worker / controller pids; job output:", file=sys.stderr)
        finish(launcher, 5)
        return 1
    time.sleep(1.0)  # past the first steps (warm-up)
    recorders = {}
    for role, pid in (("worker", worker_pid), ("controller", controller_pid)):
        recorders[role] = subprocess.Popen(
            [pyspy, "record", "--pid", str(pid), "--rate", str(args.rate), "--idle", "--threads",
             "--format", "raw", "--duration", str(args.duration), "--output", str(out / f"{role}.raw")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for role, rec in recorders.items():
        text, _ = rec.communicate(timeout=args.duration + 60)
        if rec.returncode != 0:
            print(f"py-spy on the {role} failed: {text.strip()[-500:]}", file=sys.stderr)
    rc2, _ = finish(launcher, 300)
    prof_path = job_dir / "summary.json"
    profiled = step_time_of(json.loads(prof_path.read_text())) if prof_path.exists() else None
    print(f"      rc={rc2} {profiled}", file=sys.stderr, flush=True)

    profiles = {}
    for role, cats, fbs, inner in (("worker", WORKER_CATEGORIES, WORKER_FALLBACKS, False),
                                   ("controller", CONTROLLER_CATEGORIES, CONTROLLER_FALLBACKS, True)):
        raw = out / f"{role}.raw"
        if raw.exists():
            profiles[role] = categorize(parse_raw(raw), cats, fbs, inner)
    result = {
        "benchmark": "step_time",
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "git": git_revision(),
        "config": {"replicas": 4, "agents": 2, "global_microbatches": 16, "microbatch_size": 8,
                   "model": "default", "plain_steps": args.steps, "profile_steps": args.profile_steps,
                   "pyspy": f"rate {args.rate}/s, {args.duration}s, --idle --threads",
                   "profiled_replica": args.replica},
        "noise": {"start": noise_start, "end": foreign_load()},
        "plain": plain,
        "profiled": profiled,
        "profiles": profiles,
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")

    m = result["machine"]
    print(f"step time, {result['date']}: {m['nproc']} cpus ({m['cpu_model']}), python {m['python']}, "
          f"torch {m['torch']}, git {result['git']}")
    for name, st in (("plain", plain), ("profiled", profiled)):
        if st and st["step_time"]:
            t = st["step_time"]
            print(f"{name:<9} median {t['median_s'] * 1000:6.1f} ms = compute {t['compute_s'] * 1000:6.1f}"
                  f" + reduce {t['reduce_s'] * 1000:5.1f} + control {t['control_s'] * 1000:5.1f} ms"
                  f"  ({st['steps_committed']} steps, train {st['train_s']}s)")
    per_step = profiled["train_s_per_step"] if profiled else None
    for role, prof in profiles.items():
        # ms per step: the fraction times the profiled job's mean wall time per step
        prof["ms_per_step"] = {k: round(v * per_step * 1000, 2) for k, v in prof["fractions"].items()} \
            if per_step else {}
        print(f"{role} main thread ({prof['samples_main_thread']} samples"
              + (f"; ms/step at {per_step * 1000:.1f} ms per step" if per_step else "") + "):")
        for k, v in prof["fractions"].items():
            ms = f"{prof['ms_per_step'][k]:6.1f} ms" if per_step else ""
            print(f"  {v * 100:5.1f}%  {ms}  {k}")
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {out / 'results.json'}")
    return 0 if rc == 0 and rc2 == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
