"""The leader's own cost of a registration burst (N agents register, then report ready),
and of the generation one agent's loss then makes.

    python bench/scripts/registration_burst.py --sizes 1000,3000,12500

In process, on the real `Coordinator` over the in-memory store, with no network and no
clients: what the leader's transitions cost per agent as the job grows (the gRPC path
is measured by `recover bench controller`). A cost per agent that grows with N is a
quadratic burst. A loss is timed twice: as the transition alone (what a leader behind
relays pays: each relay gets the new view once), with every agent's message serialized
on its own (what gRPC did for direct sessions: N copies of a view of N members), and
through the sessions' response serializer (`gate.SerializedOnce`: the same message object
serialized once for all agents). Not measured here: gRPC's own per-message write, which
every agent's copy still costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

from recover.controller.coordinator import Coordinator
from recover.controller.gate import SerializedOnce
from recover.controller.store import MemoryStore
from recover.proto import pb


async def burst(n: int) -> dict[str, float]:
    job = pb.JobConfig(job_id="burst", replicas=n, steps=5, global_microbatches=n, seed=0,
                       reduce="fast", policy="recover",
                       workload=pb.WorkloadSpec(command=["python", "train.py"]))
    serialize: list[object] = [None]

    def send(agent: str, message: pb.ControllerMessage) -> None:
        if serialize[0] is not None:
            serialize[0](message)  # type: ignore[operator]

    coordinator = Coordinator(job, MemoryStore(), send, "127.0.0.1:1")
    began = time.perf_counter()
    for i in range(n):
        await coordinator.register_agent(f"sim-{i:05d}", "sim", 1)
    registered = time.perf_counter()
    for replica in range(n):
        await coordinator.worker_ready(replica, pb.Ready(pid=1, param_sha256="sim"))
    ready = time.perf_counter()
    losses = []
    for index, serializer in enumerate((None, pb.ControllerMessage.SerializeToString,
                                        SerializedOnce())):
        serialize[0] = serializer
        lost = time.perf_counter()
        await coordinator.agent_lost(f"sim-{index:05d}", "measured")
        losses.append(round((time.perf_counter() - lost) * 1e3, 2))
    return {"agents": n, "loss_generation_ms": losses[0], "loss_generation_serialized_ms": losses[1],
            "loss_generation_serialized_once_ms": losses[2],
            "register_s": round(registered - began, 3),
            "register_ms_each": round((registered - began) / n * 1e3, 4),
            "ready_s": round(ready - registered, 3),
            "ready_ms_each": round((ready - registered) / n * 1e3, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,3000,12500")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # an event per registration: not what is measured
    for n in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(asyncio.run(burst(n))), flush=True)


if __name__ == "__main__":
    main()
