"""Simulated racks: `python -m recover.bench.sim_racks CONTROLLER FIRST COUNT --racks R`.

The leader's side of a job of 10,000+ agents, on a machine that cannot host that many agents'
gRPC clients and relays (BENCHMARKS.md section 5: ~3,000 here). Behind relays the leader
never sees an agent's connection: it sees one `RelayLink.Relay` stream per rack carrying
its agents' messages in batches (controller/relayed.py). This process opens R such streams,
each with a connection of its own as a relay has, and speaks for COUNT agents split among
them (ids FIRST.. on), exactly as `recover relay` does on the wire: the relay's name, its
agents' registrations, each agent's worker `ready` once it is registered, keepalives while
nothing else goes up, and an agent's session ending (`closed`) when one dies. So the
leader's work per agent is the real one (registration with its store write, planning,
liveness, the broadcast per relay); what is not here is the relay tier's own work
(each agent's session with its relay, their beats), which runs on the racks' own hosts
and is measured with real relays in the same benchmark (`--relays`).

Control over stdin/stdout, as `sim_agents` (one line each way):
* prints `up` once every agent of this process has received generation 1;
* stdin `kill` ends the session of the next live agent (its death), round robin over racks;
* stdin `stop` (or EOF) ends the streams and prints one JSON line in `sim_agents`' shape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from recover.proto import pb, rpc

KEEPALIVE_S = 0.5
"""As `recover relay`'s: the stream is never silent longer (the leader counts the rack alive)."""


@dataclass
class SimRack:
    """One rack's relay stream and what its agents saw."""

    relay_id: str
    agent_ids: list[str]
    replica: dict[str, int] = field(default_factory=dict)
    register_rtt_s: dict[str, float] = field(default_factory=dict)
    generations: dict[str, dict[int, float]] = field(default_factory=dict)
    """Agent -> generation number -> Unix time the rack received it for that agent."""
    ended: dict[str, str] = field(default_factory=dict)
    """Agents whose sessions ended (killed here, or ended by the leader: why)."""
    error: str | None = None
    up: asyncio.Event = field(default_factory=asyncio.Event)
    outbox: asyncio.Queue[pb.RelayUp | None] = field(default_factory=asyncio.Queue)
    sent_at: float = 0.0

    def send(self, messages: list[pb.RelayedMessage]) -> None:
        self.outbox.put_nowait(pb.RelayUp(messages=messages))
        self.sent_at = time.monotonic()

    def next_victim(self) -> str | None:
        return next((a for a in self.agent_ids if a in self.replica and a not in self.ended), None)


async def _requests(rack: SimRack) -> AsyncIterator[pb.RelayUp]:
    while (up := await rack.outbox.get()) is not None:
        yield up


async def _keepalive(rack: SimRack) -> None:
    while True:
        await asyncio.sleep(KEEPALIVE_S / 4)
        if time.monotonic() - rack.sent_at >= KEEPALIVE_S:
            rack.send([])


def _registered(rack: SimRack, agent_id: str, message: pb.ControllerMessage,
                sent: float) -> pb.RelayedMessage:
    rack.register_rtt_s[agent_id] = time.perf_counter() - sent
    replica = rack.replica[agent_id] = message.registered.replica_ids[0]
    return pb.RelayedMessage(agent_id=agent_id, peer="127.0.0.1", message=pb.AgentMessage(
        report=pb.WorkerReport(replica=replica, ready=pb.Ready(pid=0, param_sha256="sim"))))


async def run_rack(rack: SimRack, address: str) -> None:
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own, as a relay's
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        rack.outbox.put_nowait(pb.RelayUp(relay_id=rack.relay_id))
        call = rpc.RelayLinkStub(channel).Relay(_requests(rack))
        keepalive = asyncio.create_task(_keepalive(rack))
        try:
            await call.read()  # the welcome
            sent = time.perf_counter()
            rack.send([pb.RelayedMessage(agent_id=a, peer="127.0.0.1", message=pb.AgentMessage(
                register=pb.RegisterAgent(agent_id=a, host="sim", slots=1)))
                for a in rack.agent_ids])
            while (down := await call.read()) is not grpc.aio.EOF:
                received = time.time()
                readies = []
                for delivery in down.deliveries:
                    if delivery.end:
                        for agent_id in delivery.agent_ids:
                            rack.ended.setdefault(agent_id, delivery.reason or "ended")
                        continue
                    kind = delivery.message.WhichOneof("kind")
                    for agent_id in delivery.agent_ids:
                        if kind == "registered":
                            readies.append(_registered(rack, agent_id, delivery.message, sent))
                        elif kind == "generation":
                            generation = delivery.message.generation.generation
                            rack.generations.setdefault(agent_id, {})[generation] = received
                if readies:
                    rack.send(readies)
                if not rack.up.is_set() and all(1 in rack.generations.get(a, {})
                                                for a in rack.agent_ids):
                    rack.up.set()
        except grpc.aio.AioRpcError as exc:
            rack.error = f"{exc.code().name}: {exc.details()}"
        finally:
            keepalive.cancel()
            rack.outbox.put_nowait(None)
            call.cancel()


def split(first: int, count: int, racks: int) -> list[list[str]]:
    """The agent ids of each rack, as even as can be (pure)."""
    ids = [f"sim-{first + i:05d}" for i in range(count)]
    return [ids[r::racks] for r in range(racks) if ids[r::racks]]


async def main_async(address: str, first: int, count: int, racks: int) -> dict[str, object]:
    rack_list = [SimRack(f"simrack-{first:05d}-{r}", ids)
                 for r, ids in enumerate(split(first, count, racks))]
    tasks = [asyncio.create_task(run_rack(rack, address)) for rack in rack_list]
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def announce() -> None:
        ups = [asyncio.create_task(rack.up.wait()) for rack in rack_list]
        done, _ = await asyncio.wait([asyncio.gather(*ups), *tasks],
                                     return_when=asyncio.FIRST_COMPLETED)
        failed = [rack for rack in rack_list if not rack.up.is_set()]
        print("up" if not failed else f"rack {failed[0].relay_id} failed: "
              f"{failed[0].error or 'stream ended'}", flush=True)

    announcer = asyncio.create_task(announce())
    killed_at: list[float | None] = []
    victims: list[int] = []
    turn = 0
    while (await reader.readline()).strip() == b"kill":
        # The next rack with a live agent, in turn; none left: the kill is noted as not made
        # (None), so that the driver's count of this process's kills stays in step.
        found = next(((rack, victim) for rack in rack_list[turn:] + rack_list[:turn]
                      if (victim := rack.next_victim()) is not None), None)
        turn = (turn + 1) % len(rack_list)
        if found is None:
            killed_at.append(None)
            continue
        rack, victim = found
        killed_at.append(time.time())
        victims.append(rack.replica[victim])
        rack.ended[victim] = "killed"
        rack.send([pb.RelayedMessage(agent_id=victim, closed=True, reason="simulated death")])
    announcer.cancel()
    for rack in rack_list:
        rack.outbox.put_nowait(None)
    await asyncio.wait(tasks, timeout=5)
    for task in tasks:
        task.cancel()
    agents = [(rack, a) for rack in rack_list for a in rack.agent_ids]
    return {"killed_at": killed_at[0] if killed_at else None, "kills_at": killed_at,
            "victim": victims[0] if victims else -1, "victims": victims,
            "register_rtt_s": [rack.register_rtt_s.get(a) for rack, a in agents],
            "generations": [{str(g): t for g, t in rack.generations.get(a, {}).items()}
                            for rack, a in agents],
            "replicas": [rack.replica.get(a, -1) for rack, a in agents],
            "heartbeats": 0, "racks": len(rack_list), "kind": "racks",
            "errors": [rack.error for rack in rack_list if rack.error],
            "retries": []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("controller")
    parser.add_argument("first", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("--racks", type=int, default=1, help="relay streams to split them over")
    args = parser.parse_args()
    result = asyncio.run(main_async(args.controller, args.first, args.count, args.racks))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
