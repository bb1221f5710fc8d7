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

    python bench/scripts/registration_burst.py --collector default   # or freeze, off

`--collector`: instead, after a burst of 12,500, 8 losses in a row with Python's cyclic
garbage collector as it is, frozen after the burst (`gc.freeze()`) or off, each printed in
ms with `*G` when the collector ran generation G during it (BENCHMARKS.md section 5).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable

from recover.controller.coordinator import Coordinator
from recover.controller.gate import SerializedOnce
from recover.controller.store import MemoryStore
from recover.proto import pb


async def registered_and_ready(n: int, send: Callable[[str, pb.ControllerMessage], None],
                               ) -> tuple[Coordinator, float, float]:
    """A coordinator for a job of n one-slot agents, each registered, then each replica
    ready; and the seconds each half of that burst took."""
    job = pb.JobConfig(job_id="burst", replicas=n, steps=5, global_microbatches=n, seed=0,
                       reduce="fast", policy="recover",
                       workload=pb.WorkloadSpec(command=["python", "train.py"]))
    coordinator = Coordinator(job, MemoryStore(), send, "127.0.0.1:1")
    began = time.perf_counter()
    for i in range(n):
        await coordinator.register_agent(f"sim-{i:05d}", "sim", 1)
    registered = time.perf_counter()
    for replica in range(n):
        await coordinator.worker_ready(replica, pb.Ready(pid=1, param_sha256="sim"))
    return coordinator, registered - began, time.perf_counter() - registered


async def burst(n: int) -> dict[str, float]:
    serialize: list[object] = [None]

    def send(agent: str, message: pb.ControllerMessage) -> None:
        if serialize[0] is not None:
            serialize[0](message)  # type: ignore[operator]

    coordinator, register_s, ready_s = await registered_and_ready(n, send)
    losses = []
    for index, serializer in enumerate((None, pb.ControllerMessage.SerializeToString,
                                        SerializedOnce())):
        serialize[0] = serializer
        lost = time.perf_counter()
        await coordinator.agent_lost(f"sim-{index:05d}", "measured")
        losses.append(round((time.perf_counter() - lost) * 1e3, 2))
    return {"agents": n, "loss_generation_ms": losses[0], "loss_generation_serialized_ms": losses[1],
            "loss_generation_serialized_once_ms": losses[2],
            "register_s": round(register_s, 3),
            "register_ms_each": round(register_s / n * 1e3, 4),
            "ready_s": round(ready_s, 3),
            "ready_ms_each": round(ready_s / n * 1e3, 4)}


async def losses_by_collector(mode: str, n: int = 12_500, losses: int = 8) -> str:
    """`losses` losses in a row after a burst of n, the collector as `mode` says."""
    coordinator, _, _ = await registered_and_ready(n, lambda agent, message: None)
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    elif mode == "off":
        gc.disable()
    ran: list[int] = []
    gc.callbacks.append(lambda phase, info: ran.append(info["generation"])
                        if phase == "start" else None)
    times = []
    for k in range(losses):
        ran.clear()
        began = time.perf_counter()
        await coordinator.agent_lost(f"sim-{k:05d}", "measured")
        took = (time.perf_counter() - began) * 1e3
        times.append(f"{took:.0f}" + (f"*{max(ran)}" if ran else ""))
    return f"{mode} " + " ".join(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,3000,12500")
    parser.add_argument("--collector", choices=("default", "freeze", "off"))
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # an event per registration: not what is measured
    if args.collector:
        print(asyncio.run(losses_by_collector(args.collector)), flush=True)
        return
    for n in (int(s) for s in args.sizes.split(",")):
        print(json.dumps(asyncio.run(burst(n))), flush=True)


if __name__ == "__main__":
    main()
