"""Checkpoint-and-restart baseline: its own supervisor, torchrun-style.

The supervisor starts one plain gloo worker per live slot (bench/ckpt_worker.py),
watches them, and on ANY worker failure stops every worker (SIGKILL) and starts
them all again on the slots still alive; they resume from the newest checkpoint.
Nothing is kept warm between attempts, so every restart pays process start,
`import torch`, the gloo rendezvous and the checkpoint load, plus the work done
since the checkpoint, exactly as torchrun / TorchElastic do.

Failures come from a schedule (bench/schedules.py: a slot is lost at a wall
time after the first committed step and, if the schedule says so, comes back
after a repair; returned slots are used at the next restart), or from
step-based kills (`--kill step=S,replica=R,...`: the process on slot R
SIGKILLs itself as step S starts; a process crash, so the slot stays usable).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from recover.bench.ckpt_policy import CheckpointPolicy
from recover.bench.reference import reference_config, tokens_per_step
from recover.bench.schedules import FailureEvent, Schedule
from recover.proto import pb

log = logging.getLogger("recover.bench")


@dataclass
class CkptRestartConfig:
    """One checkpoint-and-restart job."""

    job: pb.JobConfig
    """The same job ReCoVer runs: the built-in reference GPT (its command carries the model,
    data, microbatch size and lr), M, seed, compute_ms."""
    out: Path
    """Where worker-events.jsonl, checkpoint.pt, logs/ and summary.json go."""
    policy: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    """When rank 0 writes a checkpoint."""
    schedule: Schedule | None = None
    """Slot losses at wall times (None: none)."""
    step_kills: list[tuple[int, int]] = field(default_factory=list)
    """(step, slot): that slot's process SIGKILLs itself as the step starts (slot stays usable)."""
    poll_s: float = 0.05
    """Supervisor's monitoring period (torchrun's monitor_interval; 0.1 s by default there)."""
    max_restarts: int = 100
    """Give up after this many restarts."""
    progress: Callable[[str], None] | None = None
    """Called with a one-line status now and then (the progress display)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Supervisor:
    def __init__(self, config: CkptRestartConfig) -> None:
        self.c = config
        # Checked here, before any worker starts: a baseline can only run the reference GPT.
        self.workload = reference_config(config.job, "the ckpt-restart baseline")
        self.out = config.out
        self.events_path = self.out / "worker-events.jsonl"  # the workers tell the supervisor
        self.ckpt_path = self.out / "checkpoint.pt"
        self.alive: set[int] = set(range(config.job.replicas))
        self.returns: dict[int, float] = {}  # slot -> absolute time it is usable again
        self.pending: list[FailureEvent] = list(config.schedule.events) if config.schedule else []
        # [step, slot] kills not done yet; the workers carry them out themselves
        # (bench/ckpt_worker.py), so a fast step cannot slip past a lagging poll.
        self.step_kills = sorted([step, slot] for step, slot in config.step_kills)
        self.commits: list[tuple[float, int, float]] = []  # (unix time, step, loss), redone included
        self.checkpoints: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.attempts: list[dict[str, Any]] = []
        self.first_commit_at: float | None = None
        self._offset = 0
        self._last_progress = 0.0

    # ------------------------------------------------------------ processes

    def _start(self, attempt: int) -> dict[int, subprocess.Popen[bytes]]:
        slots = sorted(self.alive)
        port = free_port()
        config_path = self.out / "worker-config.json"
        config_path.write_text(json.dumps({
            "job_hex": self.c.job.SerializeToString().hex(), "policy": self.c.policy.to_dict(),
            "checkpoint": str(self.ckpt_path), "events": str(self.events_path),
            "slots": slots, "self_kills": self.step_kills}))
        procs: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []
        for rank, slot in enumerate(slots):
            f = open(self.out / "logs" / f"attempt{attempt:02d}-slot{slot}.log", "wb")  # noqa: SIM115
            self._logs.append(f)
            procs[slot] = subprocess.Popen(
                [sys.executable, "-m", "recover.bench.ckpt_worker", str(config_path), str(rank),
                 str(len(slots)), str(port)], stdout=f, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        return procs

    def _stop(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        for p in procs.values():
            p.wait()
        for f in self._logs:
            f.close()

    # ------------------------------------------------------------ monitoring

    def _read_events(self, attempt: dict[str, Any]) -> None:
        with open(self.events_path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self._offset += end
        for line in data[:end].splitlines():
            e = json.loads(line)
            if e["event"] == "step":
                self.commits.append((e["at"], e["step"], e["loss"]))
                if self.first_commit_at is None:
                    self.first_commit_at = e["at"]
                attempt.setdefault("first_step", e["step"])
                attempt["last_step"] = e["step"]
                attempt.setdefault("first_commit_at", e["at"])
            elif e["event"] == "checkpoint":
                self.checkpoints.append({"step": e["step"], "write_s": e["write_s"],
                                         "at": e["at"], "reason": e["reason"]})
            elif e["event"] == "kill":
                # The worker killed itself at the start of the step (deterministic even
                # when this poll lags behind a fast job); it must not happen again.
                kill = [e["step"], e["slot"]]
                if kill in self.step_kills:
                    self.step_kills.remove(kill)
                self.failures.append({"slot": e["slot"], "cause": "kill-spec", "killed_at": e["at"],
                                      "step": e["step"], "hit_running_worker": True})
            elif e["event"] == "ready":
                attempt.setdefault("ready", []).append(e)

    def _inject(self, procs: dict[int, subprocess.Popen[bytes]], now: float) -> None:
        for slot, back in list(self.returns.items()):
            if now >= back:  # repaired: usable from the next restart on
                self.alive.add(slot)
                del self.returns[slot]
        if self.first_commit_at is not None:
            rel = now - self.first_commit_at
            while self.pending and self.pending[0].at_s <= rel:
                event = self.pending.pop(0)
                self.alive.discard(event.slot)
                if event.returns_at_s is not None:
                    self.returns[event.slot] = self.first_commit_at + event.returns_at_s
                self._kill(procs, event.slot, now, "schedule")

    def _kill(self, procs: dict[int, subprocess.Popen[bytes]], slot: int, now: float,
              cause: str) -> None:
        proc = procs.get(slot)
        running = proc is not None and proc.poll() is None
        if running:
            assert proc is not None
            os.kill(proc.pid, signal.SIGKILL)
        self.failures.append({"slot": slot, "cause": cause, "killed_at": now,
                              "step": self.commits[-1][1] + 1 if self.commits else 0,
                              "hit_running_worker": running})

    def _show(self, attempt: int, world: int, force: bool = False) -> None:
        if self.c.progress is None or (not force and time.time() - self._last_progress < 2.0):
            return
        self._last_progress = time.time()
        step = self.commits[-1][1] + 1 if self.commits else 0
        self.c.progress(f"ckpt-restart: step {step}/{self.c.job.steps}  attempt {attempt}  "
                        f"world {world}  restarts {len(self.attempts) - 1}  "
                        f"checkpoints {len(self.checkpoints)}")

    def _monitor(self, procs: dict[int, subprocess.Popen[bytes]], attempt: dict[str, Any]) -> bool:
        """Until every worker exits 0 (True) or any worker fails (False)."""
        while True:
            now = time.time()
            self._read_events(attempt)
            self._inject(procs, now)
            codes = [p.poll() for p in procs.values()]
            if any(code not in (None, 0) for code in codes):
                attempt["failed_at"] = now
                return False
            if all(code == 0 for code in codes):
                self._read_events(attempt)
                return True
            self._show(attempt["n"], len(procs))
            time.sleep(self.c.poll_s)

    # ------------------------------------------------------------ the job

    def run(self) -> dict[str, Any]:
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        self.ckpt_path.unlink(missing_ok=True)
        self.events_path.write_bytes(b"")
        launched = time.time()
        state, reason = "failed", f"gave up after {self.c.max_restarts} restarts"
        for n in range(self.c.max_restarts + 1):
            attempt: dict[str, Any] = {"n": n, "started_at": time.time(), "world": len(self.alive),
                                       "slots": sorted(self.alive)}
            self.attempts.append(attempt)
            procs = self._start(n)
            try:
                ok = self._monitor(procs, attempt)
            finally:
                self._stop(procs)
            attempt["stopped_at"] = time.time()
            self._show(n, len(procs), force=True)
            if ok:
                state, reason = "succeeded", ""
                break
        return self._summary(launched, time.time(), state, reason)

    def _summary(self, launched: float, ended: float, state: str, reason: str) -> dict[str, Any]:
        job = self.c.job
        losses: dict[int, float] = {}
        committed_at: dict[int, float] = {}
        for at, step, loss in self.commits:  # a re-done step's last commit is the one that counts
            losses[step], committed_at[step] = loss, at
        steps = len(losses)
        per_step = tokens_per_step(job, self.workload)
        restarts = []
        for prev, nxt in zip(self.attempts, self.attempts[1:], strict=False):
            ready = nxt.get("ready", [])
            restarts.append({
                "failed_at_s": round(prev.get("failed_at", prev["stopped_at"]) - launched, 4),
                "stop_s": round(prev["stopped_at"] - prev.get("failed_at", prev["stopped_at"]), 4),
                "import_s": round(max(r["import_s"] for r in ready), 4) if ready else None,
                "rendezvous_s": round(max(r["rendezvous_s"] for r in ready), 4) if ready else None,
                "load_s": round(max(r["load_s"] for r in ready), 4) if ready else None,
                "resumed_from_step": nxt.get("first_step"),
                "world": nxt["world"],
                # committed before the failure but not checkpointed: computed twice
                "lost_steps": prev["last_step"] + 1 - nxt["first_step"]
                if "first_step" in nxt and "last_step" in prev else None,
                # failure detected -> first step committed again (the whole price but lost work)
                "restart_s": round(nxt["first_commit_at"] - prev["failed_at"], 4)
                if "first_commit_at" in nxt and "failed_at" in prev else None,
            })
        redone = len(self.commits) - steps
        return {
            "mode": "ckpt-restart", "state": state, "reason": reason, "job_id": job.job_id,
            "replicas": job.replicas, "steps_requested": job.steps, "steps_committed": steps,
            "global_microbatches": job.global_microbatches,
            "microbatch_size": self.workload.microbatch_size,
            "compute_ms": job.testing.compute_ms,
            "loss_per_step": [losses[s] for s in sorted(losses)],
            "tokens": steps * per_step,
            "wall_s": round(ended - launched, 3),
            "launched_at": launched,
            "end_s": round(max(committed_at.values()) - launched, 4) if committed_at else None,
            "first_commit_at": self.first_commit_at,
            # Every commit, re-done steps included: (seconds since launch, step).
            "commit_timeline": [[round(at - launched, 4), step] for at, step, _ in self.commits],
            "steps_redone": redone,
            "checkpoints": self.checkpoints,
            "checkpoint_policy": self.c.policy.to_dict(),
            "failures": [{**f, "killed_at_s": round(f["killed_at"] - launched, 4)}
                         for f in self.failures],
            "restarts": restarts,
            "attempts": [{"n": a["n"], "world": a["world"], "slots": a["slots"],
                          "first_step": a.get("first_step")} for a in self.attempts],
        }


def run(config: CkptRestartConfig) -> dict[str, Any]:
    """Run the baseline job to the end; write and return OUT/summary.json's content."""
    summary = Supervisor(config).run()
    (config.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
