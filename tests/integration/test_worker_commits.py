"""A real worker process under a scripted agent channel: a commit sent twice is applied once.

After a leader change the new leader re-sends the last commit; the agent may pass
it to a worker that applied it while its `applied` report was still on the way
(seen in bench/scripts/failover.py: the worker stopped with "does not match").
The scripted agent is a test seam: the worker, its gloo group and its rendezvous
store are real.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from recover.cli.jobargs import add_job_arguments, job_from_args
from recover.proto import pb, rpc
from recover.trainer.groups.gloo import RendezvousServer

pytestmark = pytest.mark.timeout(120)


class ScriptedAgent(rpc.WorkerChannelServicer):
    """Welcomes one worker, then sends what the test puts in `commands`; keeps its reports."""

    def __init__(self, job: pb.JobConfig) -> None:
        self.job = job
        self.worker: subprocess.Popen[bytes] | None = None
        self.commands: asyncio.Queue[pb.WorkerCommand | None] = asyncio.Queue()
        self.reports: asyncio.Queue[pb.WorkerReport] = asyncio.Queue()
        self.held: list[pb.WorkerReport] = []
        """Reports read while waiting for another kind: a step's `applied` (its digest
        hashed on a thread) may come after the next step's `reduced`."""

    async def Attach(self, request_iterator: AsyncIterator[pb.WorkerReport],  # noqa: N802
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.WorkerCommand]:
        async def read() -> None:
            async for report in request_iterator:
                if report.WhichOneof("kind") == "reduced":  # earlier steps' applied, folded in
                    for applied in report.reduced.applied:
                        await self.reports.put(pb.WorkerReport(replica=report.replica,
                                                               applied=applied))
                await self.reports.put(report)

        reader = asyncio.create_task(read())
        try:
            yield pb.WorkerCommand(welcome=pb.Welcome(replica=0, job=self.job))
            while (command := await self.commands.get()) is not None:
                yield command
        finally:
            reader.cancel()

    async def NoteFault(self, request: pb.FaultNote, context: grpc.aio.ServicerContext  # noqa: N802
                        ) -> pb.Ack:
        return pb.Ack()

    async def next_report(self, kind: str) -> pb.WorkerReport:
        for index, held in enumerate(self.held):
            if held.WhichOneof("kind") == kind:
                return self.held.pop(index)
        for _ in range(600):
            try:
                report = await asyncio.wait_for(self.reports.get(), 0.1)
            except TimeoutError:
                if self.worker is not None and self.worker.poll() is not None:
                    stderr = self.worker.stderr.read().decode() if self.worker.stderr else ""
                    raise AssertionError(f"the worker exited waiting for {kind!r}:\n{stderr}"
                                         ) from None
                continue
            if report.WhichOneof("kind") == kind:
                return report
            self.held.append(report)
        raise AssertionError(f"no {kind!r} report within 60 s")


def test_a_commit_sent_again_after_it_was_applied_is_ignored(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    job = job_from_args(parser.parse_args(["--replicas", "1", "--steps", "2", "-M", "2", "-B", "2"]))
    job.workload.command[0] = sys.executable  # what an agent does with a leading `python`

    async def scenario() -> None:
        rendezvous = RendezvousServer()
        agent = ScriptedAgent(job)
        server = grpc.aio.server()
        rpc.add_WorkerChannelServicer_to_server(agent, server)
        socket_path = tmp_path / "workers.sock"
        server.add_insecure_port(f"unix:{socket_path}")
        await server.start()
        env = {**os.environ, "RECOVER_REPLICA_ID": "0", "RECOVER_AGENT_ADDR": f"unix:{socket_path}"}
        env.pop("RECOVER_AGENT_PID", None)
        worker = subprocess.Popen(list(job.workload.command), env=env,
                                  stderr=subprocess.PIPE)
        agent.worker = worker
        try:
            await agent.next_report("ready")
            plan = pb.Plan(step=0, generation=1, assignments=[
                pb.Assignment(replica=0, microbatch_ids=[0, 1])])
            await agent.commands.put(pb.WorkerCommand(generation=pb.GenerationView(
                generation=1, members=[0], rendezvous=f"127.0.0.1:{rendezvous.port}", plan=plan)))
            await agent.next_report("reduced")
            next_plan = pb.Plan(step=1, generation=1, assignments=plan.assignments)
            commit = pb.Commit(step=0, generation=1, next_plan=next_plan)
            await agent.commands.put(pb.WorkerCommand(commit=commit))
            first = await agent.next_report("applied")
            # The duplicate: what a new leader's re-sent commit looks like to this worker.
            await agent.commands.put(pb.WorkerCommand(commit=commit))
            await agent.next_report("reduced")  # step 1 goes on
            await agent.commands.put(pb.WorkerCommand(commit=pb.Commit(step=1, generation=1,
                                                                       final=True)))
            second = await agent.next_report("applied")
            assert (first.applied.step, second.applied.step) == (0, 1)  # each step applied once
            await agent.commands.put(pb.WorkerCommand(shutdown=pb.Shutdown(reason="done", success=True)))
            code = await asyncio.to_thread(worker.wait, 30)
            stderr = worker.stderr.read().decode() if worker.stderr else ""
            assert code == 0, stderr
            assert "commit ignored: step 0 is already applied" in stderr
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            await server.stop(None)
            rendezvous.close()

    asyncio.run(scenario())
