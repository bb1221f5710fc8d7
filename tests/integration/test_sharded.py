"""Sharded replicas (`--ranks-per-replica`): FSDP2 or pipeline stages inside each replica, the
replica lost as a unit, each rank's gradient shard (or stage) reduced across replicas.

Real processes, because a replica of several ranks exists only as processes: FSDP2's
all-gathers and reduce-scatters on the replica's own group, the agent killing a broken
replica's other ranks, a rank's cross-replica group per shard. One killed run is checked
by many assertions (each run costs ~15 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from recover.common import ckptfile
from tests.integration.conftest import (
    REPO,
    alive,
    assert_bitwise_identical,
    recover_cmd,
    run_recover,
    wait_for,
)

pytestmark = pytest.mark.slow

EXAMPLE = str(REPO / "examples" / "hsdp.py")
PIPELINE = str(REPO / "examples" / "pipeline.py")
# A group timeout far beyond the test's own: a survivor that waited for a collective to
# time out, instead of being cut loose by the new generation, would fail the test.
LAYOUT = ["--replicas", "3", "--ranks-per-replica", "2", "--steps", "6", "-M", "6",
          "--seed", "3", "--reduce", "exact", "--group-timeout", "600", "--quiet"]
NO_RESTARTS = ["--max-restarts", "0"]  # the lost replicas stay lost: see the rejoin test
FAULTS = ["step=1,replica=1,phase=backward,rank=1",  # inside FSDP's reduce-scatter hook
          "step=3,replica=2,phase=reduce",            # rank 0, in the cross-replica reduce
          "step=4,replica=0,phase=forward,rank=1"]    # the last replica: a total loss
# Count-balanced plans, so the slow replica keeps a share to give away at every step.
STEALING = ["--work-stealing", "--policy", "recover", "--compute-ms", "30",
            "--slowdown", "replica=1,factor=4,from_step=1"]
PIPELINE_FAULTS = ["step=1,replica=1,phase=forward",           # stage 0, as the schedule starts
                   "step=3,replica=2,phase=stop,rank=1"]       # SIGSTOP: the watchdog kills it


def pids_by_replica(logs: Path) -> dict[int, list[int]]:
    """The worker pids the agents say they spawned, by replica (on every agent it spans)."""
    found: dict[int, list[int]] = {}
    for log in sorted(logs.glob("agent-*.log")):
        for line in log.read_text().splitlines():
            if (m := re.search(r'spawned worker pids? ([\d, ]+) on slots? .*replica=(\d+)', line)):
                found.setdefault(int(m[2]), []).extend(int(p) for p in m[1].split(", "))
    return found


def test_hsdp_exact_is_bitwise_through_a_rank_lost_in_each_phase_and_a_resume(
        tmp_path: Path) -> None:
    """Every replica lost, one per phase (the last one a total loss), then the job resumed
    from its newest checkpoint: a set of one file per rank, each rank's shards. The
    failure-free run it is compared with steals work: replica 1 is 4x slower, and the
    others take its unstarted microbatches (rank 0 answers the Release for its replica,
    both ranks drop the same microbatches), so both ways of splitting a step are checked
    against each other, bit for bit."""
    reference = run_recover(tmp_path / "reference", *LAYOUT, *STEALING, "--", "python",
                            EXAMPLE, "--save", str(tmp_path / "reference.pt"), timeout=240)
    assert reference.returncode == 0, reference.stderr
    assert reference.summary["work_stealing"] and sum(reference.summary["stolen_per_step"]) > 0
    loads = reference.summary["microbatches_by_replica_per_step"]
    assert all(sum(step.values()) == 6 for step in loads)
    assert any(step.get("1", 2) < 2 for step in loads[1:])  # the slow one gave some away
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1"]
    killed = run_recover(tmp_path / "killed", *LAYOUT, *NO_RESTARTS, *checkpoints,
                         *[part for fault in FAULTS for part in ("--kill", fault)],
                         # The same command as the resumed run's (a resume checks it).
                         "--", "python", EXAMPLE, "--save", str(tmp_path / "resumed.pt"),
                         timeout=240)
    assert killed.returncode != 0 and "all replicas lost" in killed.stdout + killed.stderr
    # Each fault lost its whole replica.
    assert [(f["replica"], f["phase"], f["cause"]) for f in killed.summary["failures"]] == [
        (1, "backward", "injected"), (2, "reduce", "injected"), (0, "forward", "injected")]
    # The agent killed each lost replica's other rank at once (no rank of it lingers), and
    # every process of the job is gone.
    agent_logs = "".join(p.read_text() for p in (tmp_path / "killed" / "logs").glob("agent-*"))
    assert agent_logs.count("killed the replica's other ranks") == 3, agent_logs
    pids = pids_by_replica(tmp_path / "killed" / "logs")
    assert sorted(pids) == [0, 1, 2] and all(len(p) == 2 for p in pids.values())
    assert not [pid for ranks in pids.values() for pid in ranks if alive(pid)]
    # The newest checkpoint is complete: rank 0's head and rank 1's file beside it.
    assert (tmp_path / "ckpt" / "ckpt-0000000004.rcv").exists()
    assert (tmp_path / "ckpt" / "ckpt-0000000004.rank1.rcv").exists()

    resumed = run_recover(tmp_path / "resumed", *LAYOUT, *checkpoints,
                          "--resume", str(tmp_path / "ckpt"),
                          "--", "python", EXAMPLE, "--save", str(tmp_path / "resumed.pt"),
                          timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    # Every step summed all 6 microbatches and the parameters after every step are the
    # failure-free run's, bit for bit, on every live replica, and so is the saved model.
    assert_bitwise_identical(resumed.summary, reference.summary)
    assert resumed.summary["microbatches_per_step"] == [6] * 6
    # The failures the checkpoint's ledger holds (those of the steps it covers; the total
    # loss after them is in the killed run's summary) are in the resumed run's. A failure
    # goes in the record of the first step committed after it was seen: the kill timed to
    # land inside step 3's reduce may land just after that reduce finished on a busy machine
    # (step 3 then commits with replica 2's part), and its failure goes in step 4's record,
    # which no checkpoint holds.
    meta, _ = ckptfile.read_meta(tmp_path / "ckpt" / "ckpt-0000000004.rcv")
    held = [(f.step, f.replica, f.phase) for record in meta.ledger for f in record.failures]
    assert held in ([(1, 1, "backward"), (3, 2, "reduce")], [(1, 1, "backward")]), held
    assert [(f["step"], f["replica"], f["phase"]) for f in resumed.summary["failures"]] == held
    want = torch.load(tmp_path / "reference.pt")
    got = torch.load(tmp_path / "resumed.pt")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # One model out of the newest set (a file per rank, each its FSDP2 shards): the same
    # bits as the script's own gather.
    exported = tmp_path / "exported.pt"
    done = subprocess.run(recover_cmd("export", str(tmp_path / "ckpt"), str(exported)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    merged = torch.load(exported, weights_only=True)
    assert sorted(merged) == sorted(want) and all(torch.equal(merged[k], want[k]) for k in want)


REJOIN_LAYOUT = ["--replicas", "2", "--ranks-per-replica", "2", "--steps", "40", "-M", "4",
                 "--seed", "4", "--reduce", "exact", "--quiet"]


@pytest.fixture(scope="module")
def rejoin_reference(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The failure-free run of REJOIN_LAYOUT, each replica's ranks on one agent."""
    reference = run_recover(tmp_path_factory.mktemp("reference"), *REJOIN_LAYOUT,
                            "--", "python", EXAMPLE, timeout=240)
    assert reference.returncode == 0, reference.stderr
    return reference


def test_a_lost_sharded_replica_rejoins_rank_by_rank_or_a_spare_takes_its_place(
        tmp_path: Path, rejoin_reference: Any) -> None:
    """A rank killed: its replica is lost, restarted by its agent (both ranks), and joins
    with live state transfer rank by rank (donor rank k to joiner rank k, each its own
    FSDP2 shards and optimizer state); the job ends at full strength, bitwise the
    failure-free run. Steps carry 30 ms of emulated compute, so the restart (a fork from
    the warm interpreter) joins mid-run."""
    layout, reference = REJOIN_LAYOUT, rejoin_reference
    rejoined = run_recover(tmp_path / "rejoined", *layout, "--compute-ms", "30",
                           "--kill", "step=2,replica=1,phase=backward,rank=1",
                           "--", "python", EXAMPLE, timeout=240)
    assert rejoined.returncode == 0, rejoined.stderr
    summary = rejoined.summary
    assert_bitwise_identical(summary, reference.summary)
    assert [f["phase"] for f in summary["failures"]] == ["backward"]
    assert len(summary["live_replicas"]) == 2 and 1 not in summary["live_replicas"]
    assert summary["replicas_per_step"][-1] == 2  # at full strength again
    log = (tmp_path / "rejoined" / "logs" / "controller.log").read_text()
    assert "replica-joined" in log and "state-transfer" in log, log[-2000:]

    # With a hot spare (two ranks that keep a live copy, each of its donor rank's state):
    # the lost replica's place is taken at once, and its restart becomes the next spare.
    # (The kill lands as the replica applies step 6's commit: the last phase of a step.)
    spared = run_recover(tmp_path / "spared", *layout, "--spares", "1", "--compute-ms", "30",
                         "--kill", "step=6,replica=1,phase=commit,rank=1",
                         "--", "python", EXAMPLE, timeout=240)
    assert spared.returncode == 0, spared.stderr
    assert_bitwise_identical(spared.summary, reference.summary)
    assert [f["phase"] for f in spared.summary["failures"]] == ["commit"]
    log = (tmp_path / "spared" / "logs" / "controller.log").read_text()
    assert "spare-promoted: replica 2 caught up" in log, log[-2000:]


def test_a_replica_spanning_agents_is_lost_as_a_unit_and_rejoins_bitwise(
        tmp_path: Path, rejoin_reference: Any) -> None:
    """Each replica's 2 ranks on two agents of one slot (hosts, here on loopback): the ranks
    meet on a TCP store that rank 0 serves on its agent's socket. A rank killed on the agent
    without rank 0, then rank 0 of the other replica SIGSTOPped (its agent's watchdog kills
    it): each time the controller stops the replica's part on the other agent, both agents
    form a new replica that joins rank by rank across them, and every step's parameters
    are the one-agent-per-replica run's, bit for bit. Then the job resumed from one of its
    checkpoints (each set's rank-1 file written on another agent than its head), spanning
    agents again: bitwise the same run."""
    spanning = ["--agents", "4", "--compute-ms", "30"]
    checkpoints = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "8"]
    run = run_recover(tmp_path / "spanning", *REJOIN_LAYOUT, *spanning, *checkpoints,
                      "--kill", "step=2,replica=1,phase=backward,rank=1",
                      "--kill", "step=12,replica=0,phase=stop",
                      "--", "python", EXAMPLE, timeout=240)
    assert run.returncode == 0, run.stderr
    assert_bitwise_identical(run.summary, rejoin_reference.summary)
    # Each agent reports its own part: the killed rank's (the injected fault), or, should
    # the other agent's report come first on a busy machine, that of the rank that found
    # its replica broken (an external cause). The stopped rank's phase: its own note
    # ("stop"), or where the watchdog found it ("compute"; either agent's watchdog may).
    first, second = run.summary["failures"]
    assert first["replica"] == 1 and first["cause"] in ("injected", "external"), first
    assert second["replica"] == 0 and second["cause"] in ("watchdog", "external"), second
    assert run.summary["replicas_per_step"][-1] == 2  # both replaced, at full strength
    logs = tmp_path / "spanning" / "logs"
    log = (logs / "controller.log").read_text()
    formed = re.findall(r"slot-filled: agents (host\d), (host\d): new replica (\d) spanning", log)
    assert len(formed) == 4 and all(a != b for a, b, _ in formed), log[-3000:]
    assert log.count("replica-joined") == 2, log[-3000:]
    agents = {p.name: p.read_text() for p in logs.glob("agent-*.log")}
    assert all("(ranks 0..0 of 2, meeting at 127.0.0.1:" in text
               or "(ranks 1..1 of 2, meeting at 127.0.0.1:" in text for text in agents.values())
    # Both parts of each lost replica ended while the job ran (at its end an agent logs no
    # exit): the failed one, and the other one, whichever way came first: the controller
    # stopping it, its rank finding its group broken, or its own watchdog.
    for lost in (0, 1):
        holders = [text for text in agents.values() if f"replica={lost}" in text]
        assert len(holders) == 2, agents
        assert all(re.search(rf"worker exited .*replica={lost}\b", text) for text in holders)
    pids = pids_by_replica(logs)
    assert sorted(pids) == [0, 1, 2, 3] and all(len(p) == 2 for p in pids.values())
    assert not [pid for ranks in pids.values() for pid in ranks if alive(pid)]

    # The oldest set kept (the 3 newest of every 8th step: after both failures and rejoins,
    # whichever a write still running made skip) is whole, and a resume from it in the same
    # layout trains the remaining steps bitwise.
    heads = sorted(p for p in (tmp_path / "ckpt").iterdir() if ckptfile.NAME.match(p.name))
    steps = [int(ckptfile.NAME.match(h.name)[1]) for h in heads]
    assert len(steps) >= 2 and all(s % 8 == 0 and s > 12 for s in steps), steps
    assert ckptfile.rank_file(heads[0], 1).exists()
    resumed = run_recover(tmp_path / "resumed", *REJOIN_LAYOUT, *spanning,
                          "--checkpoint-dir", str(tmp_path / "ckpt-resumed"),
                          "--checkpoint-every", "8", "--resume", str(heads[0]),
                          "--", "python", EXAMPLE, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_identical(resumed.summary, rejoin_reference.summary)
    resumed_log = (tmp_path / "resumed" / "logs" / "controller.log").read_text()
    assert len(re.findall(r"new replica \d spanning", resumed_log)) == 2, resumed_log[-3000:]


def test_hsdp_batchnorm_buffers_stay_bitwise_through_a_rank_lost_and_a_rejoin(
        tmp_path: Path) -> None:
    """examples/batchnorm.py sharded 2x2: each rank's BatchNorm sees its slice of every
    microbatch and the replica commits the mean of its ranks' updates. The only job where
    buffers are averaged over a replica's ranks (a collective of their own after each
    reduction, whose result the joiner is streamed): a rank killed, its replica restarted
    and caught up, and the buffers, the first replica's eval and its saved model stay the
    failure-free run's, bitwise."""
    layout = ["--replicas", "2", "--ranks-per-replica", "2", "--steps", "8", "-M", "8",
              "--seed", "5", "--reduce", "exact", "--quiet"]
    script = str(REPO / "examples" / "batchnorm.py")

    def run(name: str, *extra: str):
        result = run_recover(tmp_path / name, *layout, *extra, "--", "python", script,
                             "--eval-out", str(tmp_path / f"{name}.jsonl"),
                             "--save", str(tmp_path / f"{name}.pt"), timeout=240)
        assert result.returncode == 0, result.stderr
        return result

    reference = run("reference")
    killed = run("killed", "--compute-ms", "50",
                 "--kill", "step=3,replica=1,phase=backward,rank=1")
    assert_bitwise_identical(killed.summary, reference.summary)  # buffers in the digests
    assert [f["phase"] for f in killed.summary["failures"]] == ["backward"]
    assert sorted(killed.summary["live_replicas"]) == [0, 2]  # replica 1's restart joined
    evals = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text()
                    .splitlines()] for name in ("reference", "killed")}
    by_step = lambda lines: sorted(lines, key=lambda e: (e["step"], e["rank"]))  # noqa: E731
    assert by_step(evals["killed"]) == by_step(evals["reference"])
    assert len(evals["reference"]) == 2 * 8
    for step in range(8):  # both ranks hold the replica's buffers, not their slices' own
        assert len({e["buffers_sha256"] for e in evals["reference"] if e["step"] == step}) == 1
    want, got = (torch.load(tmp_path / f"{n}.pt", weights_only=True)
                 for n in ("reference", "killed"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert want["1.num_batches_tracked"] == 8  # one update per step, as with one rank
    assert not torch.equal(want["1.running_mean"], torch.zeros_like(want["1.running_mean"]))


def test_pipeline_batchnorm_buffers_stay_bitwise_through_a_stage_lost(tmp_path: Path) -> None:
    """examples/batchnorm.py as two pipeline stages per replica, each with a BatchNorm of its
    own: each microbatch's update of a stage's statistics (both pipeline chunks of it) is
    reduced with the same stage of the other replica. A stage killed in backward loses its
    replica; the survivor recomputes its microbatches and every stage's buffers, step by
    step, are the failure-free run's, bitwise. (Why a test of its own: the pipeline test
    above also compares with one process per replica, which BatchNorm over chunks breaks.)"""
    layout = ["--replicas", "2", "--ranks-per-replica", "2", "--steps", "6", "-M", "4",
              "--seed", "5", "--reduce", "exact", "--quiet", *NO_RESTARTS]
    script = str(REPO / "examples" / "batchnorm.py")

    def run(name: str, *extra: str):
        result = run_recover(tmp_path / name, *layout, *extra, "--", "python", script,
                             "--pipeline", "--eval-out", str(tmp_path / f"{name}.jsonl"),
                             timeout=240)
        assert result.returncode == 0, result.stderr
        return result

    reference = run("reference")
    killed = run("killed", "--kill", "step=2,replica=1,phase=backward,rank=1")
    assert_bitwise_identical(killed.summary, reference.summary)  # buffers in the digests
    assert [(f["replica"], f["phase"]) for f in killed.summary["failures"]] == [(1, "backward")]
    evals = {name: sorted((json.loads(line) for line in (tmp_path / f"{name}.jsonl")
                           .read_text().splitlines()), key=lambda e: (e["step"], e["rank"]))
             for name in ("reference", "killed")}
    assert evals["killed"] == evals["reference"] and len(evals["reference"]) == 2 * 6
    for rank in (0, 1):  # each stage's statistics move every step, and are its own
        digests = [e["buffers_sha256"] for e in evals["reference"] if e["rank"] == rank]
        assert len(set(digests)) == 6
    assert {e["buffers_sha256"] for e in evals["reference"] if e["rank"] == 0}.isdisjoint(
        e["buffers_sha256"] for e in evals["reference"] if e["rank"] == 1)


def test_pipeline_exact_is_bitwise_through_a_stage_lost_and_matches_one_process(
        tmp_path: Path) -> None:
    """Two pipeline stages per replica (GPipe over the replica's group): a stage killed as
    the schedule starts and a stage SIGSTOPped lose their replicas; the run stays bitwise
    the failure-free one, and computes what one process per replica computes."""
    reference = run_recover(tmp_path / "reference", *LAYOUT, "--", "python", PIPELINE,
                            timeout=240)
    assert reference.returncode == 0, reference.stderr
    killed = run_recover(tmp_path / "killed", *LAYOUT, *NO_RESTARTS,
                         *[part for fault in PIPELINE_FAULTS for part in ("--kill", fault)],
                         "--", "python", PIPELINE, timeout=240)
    assert killed.returncode == 0, killed.stderr
    assert_bitwise_identical(killed.summary, reference.summary)
    assert [(f["replica"], f["phase"], f["cause"]) for f in killed.summary["failures"]] == [
        (1, "forward", "injected"), (2, "stop", "watchdog")]
    plain = LAYOUT[:LAYOUT.index("--ranks-per-replica")] + LAYOUT[LAYOUT.index("--steps"):]
    whole = run_recover(tmp_path / "whole", *plain, "--", "python", PIPELINE, timeout=240)
    assert whole.returncode == 0, whole.stderr
    assert reference.summary["loss_per_step"] == pytest.approx(
        whole.summary["loss_per_step"], rel=1e-5, abs=1e-6)
    assert reference.summary["tokens"] == whole.summary["tokens"]  # the last stage's


def test_hsdp_fast_matches_one_process_replicas(tmp_path: Path) -> None:
    """A rank's slice of each microbatch and FSDP's mean over the slices give the gradient a
    one-process replica computes: the losses agree to float rounding, through a kill."""
    base = ["--replicas", "2", "--steps", "5", "-M", "4", "--quiet"]
    sharded = run_recover(tmp_path / "sharded", *base, "--ranks-per-replica", "2",
                          "--kill", "step=2,replica=1,phase=forward,rank=1",
                          "--", "python", EXAMPLE, timeout=240)
    assert sharded.returncode == 0, sharded.stderr
    plain = run_recover(tmp_path / "plain", *base, "--", "python", EXAMPLE, timeout=240)
    assert plain.returncode == 0, plain.stderr
    losses = [json.loads((tmp_path / run / "summary.json").read_text())["loss_per_step"]
              for run in ("sharded", "plain")]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    assert sharded.summary["tokens"] == plain.summary["tokens"]  # summed over the ranks
    assert [f["phase"] for f in sharded.summary["failures"]] == ["forward"]


def test_a_model_not_sharded_over_the_replica_fails_in_one_line(tmp_path: Path) -> None:
    result = run_recover(tmp_path / "run", "--replicas", "1", "--ranks-per-replica", "2",
                         "--steps", "2", "-M", "2", "--quiet", "--",
                         "python", str(REPO / "examples" / "minimal.py"), timeout=120)
    assert result.returncode != 0
    assert "the job has 2 ranks per replica but the model's parameter" in result.stderr
    assert "fully_shard(module, mesh=job.replica_mesh)" in result.stderr
    assert "for pipeline stages, pass this rank's stage with forward_backward=" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(240)
def test_a_replica_spans_two_network_namespaces_and_rejoins_across_them(
        tmp_path: Path, rejoin_reference: Any) -> None:
    """Each replica's rank 0 on an agent beside the controller and rank 1 on an agent in
    another network namespace (another host, as far as sockets go; the hostname resolves to
    neither): the replica's store, its gloo group and a rejoin's state transfer must all find
    addresses the other host reaches. A rank killed on the far host: the replica is lost,
    re-formed from the same two agents and rejoins rank by rank across them, bitwise the
    local run's."""
    from tests.integration.test_partition import SUBNET, Namespaces

    try:
        ns = Namespaces()
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {exc}")
    address = f"{SUBNET}.1:50062"
    logs = tmp_path / "logs"
    logs.mkdir()
    processes: list[subprocess.Popen[bytes]] = []

    def registered(agent: str) -> bool:
        text = (logs / "controller.log").read_text()
        assert processes[0].poll() is None, text[-2000:]
        return f"agent-registered: agent {agent} " in text

    try:
        processes.append(ns.run(ns.ctl, recover_cmd(
            "controller", "--host", f"{SUBNET}.1", "--port", "50062",
            *[flag for flag in REJOIN_LAYOUT if flag != "--quiet"],
            "--compute-ms", "30", "--kill", "step=3,replica=0,phase=backward,rank=1",
            "--summary-out", str(tmp_path), "--linger", "1", "--job-id", "spanning",
            "--", "python", EXAMPLE), logs / "controller.log"))
        # One agent per namespace and replica, started in turn: the controller forms each
        # replica from two agents in the order they registered (a near one, then a far one).
        for space, name in ((ns.ctl, "near0"), (ns.far, "far0"), (ns.ctl, "near1"),
                            (ns.far, "far1")):
            processes.append(ns.run(space, recover_cmd(
                "agent", "--controller", address, "--slots", "1", "--agent-id", name,
                "--log-dir", str(logs)), logs / f"agent-{name}.log"))
            wait_for(lambda: registered(name), 90, f"agent {name} to register")  # noqa: B023
        assert processes[0].wait(timeout=180) == 0, (logs / "controller.log").read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        ns.remove()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert_bitwise_identical(summary, rejoin_reference.summary)
    assert [f["replica"] for f in summary["failures"]] == [0]
    assert summary["replicas_per_step"][-1] == 2
    log = (logs / "controller.log").read_text()
    formed = re.findall(r"agents (\w+), (\w+): new replica (\d) spanning", log)
    assert formed == [("near0", "far0", "0"), ("near1", "far1", "1"),
                      ("near0", "far0", "2")], formed
    assert "replica-joined" in log
    far = (logs / "agent-far0.log").read_text()
    assert f"meeting at {SUBNET}.1:" in far, far[-2000:]


def test_pipeline_stages_on_two_agents_are_lost_as_a_unit_and_rejoin_bitwise(
        tmp_path: Path) -> None:
    """Why one more pair of jobs: pipeline stages spanning agents is the layout of a model
    too large for one host (3D parallelism), and its stage-to-stage sends cross agents. Each
    replica's stage 0 on one agent and stage 1 on another; stage 1 killed as the schedule
    runs: the replica is lost whole, re-formed from the same agents and rejoins stage by
    stage; every step's parameters are those of the layout on one agent per replica."""
    layout = ["--replicas", "2", "--ranks-per-replica", "2", "--steps", "12", "-M", "4",
              "--seed", "5", "--reduce", "exact", "--quiet"]
    reference = run_recover(tmp_path / "reference", *layout, "--", "python", PIPELINE,
                            timeout=240)
    assert reference.returncode == 0, reference.stderr
    run = run_recover(tmp_path / "spanning", *layout, "--agents", "4", "--compute-ms", "30",
                      "--kill", "step=3,replica=1,phase=forward,rank=1",
                      "--", "python", PIPELINE, timeout=240)
    assert run.returncode == 0, run.stderr
    assert_bitwise_identical(run.summary, reference.summary)
    assert [f["replica"] for f in run.summary["failures"]] == [1]
    assert run.summary["replicas_per_step"][-1] == 2
    log = (tmp_path / "spanning" / "logs" / "controller.log").read_text()
    assert len(re.findall(r"new replica \d spanning", log)) == 3 and "replica-joined" in log
