"""Training with its state in a real 3-member etcd cluster, losing a member mid-run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from recover.controller.etcd_store import EtcdStore
from recover.proto import pb, rpc
from tests.etcd_cluster import EtcdCluster
from tests.integration.conftest import recover_cmd

pytestmark = pytest.mark.slow


def test_training_survives_an_etcd_member_loss(tmp_path: Path) -> None:
    cluster = EtcdCluster(tmp_path / "etcd", 3).start()
    out = tmp_path / "run"
    proc = subprocess.Popen(
        recover_cmd("run", "--replicas", "3", "--steps", "30", "-M", "6", "-B", "4", "--seed", "3",
                    "--quiet", "--job-id", "etcd-job", "--store", cluster.url, "--out", str(out),
                    "--agents", "1",  # the store is the subject: one emulated host
                    "--kill", "step=12,replica=1,phase=backward"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port_file = out / "controller.port"
        deadline = time.monotonic() + 90
        while not (port_file.exists() and port_file.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr and proc.stderr.read()
            time.sleep(0.1)
        stub = rpc.ControlStub(grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}"))
        while True:
            try:
                if stub.Status(pb.StatusRequest(), timeout=2).steps_committed >= 3:
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        cluster.kill_member(0)  # mid-training
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    try:
        assert proc.returncode == 0, stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["steps_committed"] == 30
        assert summary["microbatches_per_step"] == [6] * 30
        assert [f["replica"] for f in summary["failures"]] == [1]

        async def ledger() -> list[pb.StepRecord]:
            store = EtcdStore(cluster.endpoints(), retry_s=15)
            items = await store.get_prefix("/recover/etcd-job/steps/")
            await store.close()
            return [pb.StepRecord.FromString(v) for _, v in items]

        # The sample ledger was persisted in etcd, step by step, before each commit.
        records = asyncio.run(ledger())
        assert [r.step for r in records] == list(range(30))
        assert [r.sample_digest for r in records] == summary["sample_digest_per_step"]
    finally:
        cluster.stop()
