"""Simulated light agents: `python -m recover.bench.sim_agents CONTROLLER FIRST COUNT`.

COUNT agents in one asyncio process, each with its own gRPC channel (own TCP
connection, as real hosts have) and one AgentSession.Session stream, speaking
the real protocol with one slot each: register, wait for `registered`,
report its worker `ready` (no worker exists), then heartbeat every
`--heartbeat` seconds (random phase) until told to stop. That is all the
controller needs to plan generation 1 and keep the job RUNNING (no step is
ever reduced, so none commits).

Control over stdin/stdout, one line each way:
* prints `up` once every agent of this process has received generation 1;
* stdin `kill` closes the stream of the process's next live agent (its death);
* stdin `stop` (or EOF) ends every session and prints one JSON line:
  register round trips, the receipt time of every generation per agent,
  the kill time, heartbeats sent, per-agent errors, and the sessions that failed
  before registering (each retried after a backoff, as a real agent would).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from recover.proto import pb, rpc


@dataclass
class SimAgent:
    """One simulated agent and what it saw."""

    agent_id: str
    replica: int = -1
    register_rtt_s: float | None = None
    generations: dict[int, float] = field(default_factory=dict)
    """Generation number -> Unix time this agent received it."""
    heartbeats: int = 0
    error: str | None = None
    retries: list[str] = field(default_factory=list)
    """Sessions that failed before registering (why each), each followed by a new one after
    a backoff, as a real agent's (agent/link.py) would be."""
    up: asyncio.Event = field(default_factory=asyncio.Event)
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    """Its last session is over (it will not retry)."""


async def _requests(agent: SimAgent, outbox: asyncio.Queue[pb.AgentMessage | None]
                    ) -> AsyncIterator[pb.AgentMessage]:
    while (message := await outbox.get()) is not None:
        yield message


async def _heartbeats(agent: SimAgent, outbox: asyncio.Queue[pb.AgentMessage | None],
                      period_s: float) -> None:
    # A random phase: real agents do not beat in lockstep.
    await asyncio.sleep(random.uniform(0, period_s))
    while not agent.closing.is_set():
        outbox.put_nowait(pb.AgentMessage(heartbeat=pb.Heartbeat(sent_at=time.time())))
        agent.heartbeats += 1
        await asyncio.sleep(period_s)


MAX_RETRIES = 20
RETRY_BACKOFF_S = 0.5


async def run_agent(agent: SimAgent, address: str, period_s: float) -> None:
    """Sessions until one registers (at most MAX_RETRIES more), then that one to its end."""
    try:
        for attempt in range(MAX_RETRIES + 1):
            await _session(agent, address, period_s)
            if agent.register_rtt_s is not None or agent.error is None or attempt == MAX_RETRIES:
                return
            agent.retries.append(agent.error)
            agent.error = None
            agent.closing.clear()
            await asyncio.sleep(RETRY_BACKOFF_S * (1 + attempt) * random.uniform(0.5, 1.5))
    finally:
        agent.ended.set()


async def _session(agent: SimAgent, address: str, period_s: float) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
        call = rpc.AgentSessionStub(channel).Session(_requests(agent, outbox))
        sent = time.perf_counter()
        outbox.put_nowait(pb.AgentMessage(register=pb.RegisterAgent(
            agent_id=agent.agent_id, host="sim", slots=1)))
        beats: asyncio.Task[None] | None = None
        try:
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "registered":
                    agent.register_rtt_s = time.perf_counter() - sent
                    agent.replica = message.registered.replica_ids[0]
                    outbox.put_nowait(pb.AgentMessage(report=pb.WorkerReport(
                        replica=agent.replica, ready=pb.Ready(pid=0, param_sha256="sim"))))
                    beats = asyncio.create_task(_heartbeats(agent, outbox, period_s))
                elif kind == "generation":
                    agent.generations[message.generation.generation] = time.time()
                    agent.up.set()
                elif kind == "shutdown":
                    break
                if agent.closing.is_set():
                    break
        except grpc.aio.AioRpcError as exc:
            if not agent.closing.is_set():
                agent.error = f"{exc.code().name}: {exc.details()}"
        finally:
            agent.closing.set()
            if beats is not None:
                beats.cancel()
            outbox.put_nowait(None)
            call.cancel()


async def main_async(address: str, first: int, count: int, period_s: float) -> dict[str, object]:
    agents = [SimAgent(f"sim-{first + i:05d}") for i in range(count)]
    tasks = [asyncio.create_task(run_agent(a, address, period_s)) for a in agents]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async def announce() -> None:
        # Up once every agent has its first generation; an agent whose session ended before
        # (refused, or its connection failed) makes the line say why instead of hanging.
        async def settled(agent: SimAgent) -> None:
            await asyncio.wait([asyncio.create_task(agent.up.wait()),
                                asyncio.create_task(agent.ended.wait())],
                               return_when=asyncio.FIRST_COMPLETED)
        await asyncio.gather(*(settled(a) for a in agents))
        failed = [a for a in agents if not a.up.is_set()]
        print("up" if not failed else f"{len(failed)} agents failed, e.g. {failed[0].agent_id}: "
              f"{failed[0].error or 'session ended'}", flush=True)

    announcer = asyncio.create_task(announce())
    kills_at: list[float | None] = []  # None: no live agent left to kill
    victims: list[int] = []
    while (await reader.readline()).strip() == b"kill":
        victim = next((i for i, a in enumerate(agents) if a.up.is_set() and not a.closing.is_set()),
                      None)
        if victim is None:
            kills_at.append(None)
            continue
        kills_at.append(time.time())
        victims.append(agents[victim].replica)
        agents[victim].closing.set()
        tasks[victim].cancel()  # closes its channel: the controller sees the stream end
    announcer.cancel()
    for agent in agents:
        agent.closing.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"killed_at": kills_at[0] if kills_at else None, "kills_at": kills_at,
            "victim": victims[0] if victims else -1, "victims": victims,
            "register_rtt_s": [a.register_rtt_s for a in agents],
            "generations": [{str(g): t for g, t in a.generations.items()} for a in agents],
            "replicas": [a.replica for a in agents],
            "heartbeats": sum(a.heartbeats for a in agents), "kind": "agents",
            "errors": [a.error for a in agents if a.error],
            "retries": [why for a in agents for why in a.retries]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("controller")
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--heartbeat", type=float, default=1.0, help="seconds between beats")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.controller, args.first, args.count, args.heartbeat))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
