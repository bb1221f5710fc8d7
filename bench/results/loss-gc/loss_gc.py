"""The generation one agent's loss makes at 12,500 agents, with the cyclic garbage collector
as it is, frozen after the registration burst, or off (BENCHMARKS.md section 5).

    python bench/results/loss-gc/loss_gc.py default|freeze|off

In process, on the real `Coordinator` over the in-memory store, messages dropped (what a
leader behind relays pays); 8 losses in a row, each printed in ms, with `*G` when the
collector ran generation G during it.
"""

import asyncio
import gc
import logging
import sys
import time

from recover.controller.coordinator import Coordinator
from recover.controller.store import MemoryStore
from recover.proto import pb

AGENTS = 12_500


async def main(mode: str) -> None:
    job = pb.JobConfig(job_id="burst", replicas=AGENTS, steps=5, global_microbatches=AGENTS,
                       seed=0, reduce="fast", policy="recover",
                       workload=pb.WorkloadSpec(command=["python", "train.py"]))
    coordinator = Coordinator(job, MemoryStore(), lambda agent, message: None, "127.0.0.1:1")
    for i in range(AGENTS):
        await coordinator.register_agent(f"sim-{i:05d}", "sim", 1)
    for replica in range(AGENTS):
        await coordinator.worker_ready(replica, pb.Ready(pid=1, param_sha256="sim"))
    if mode == "freeze":
        gc.collect()
        gc.freeze()
    elif mode == "off":
        gc.disable()
    ran: list[int] = []
    gc.callbacks.append(lambda phase, info: ran.append(info["generation"])
                        if phase == "start" else None)
    times = []
    for k in range(8):
        ran.clear()
        began = time.perf_counter()
        await coordinator.agent_lost(f"sim-{k:05d}", "measured")
        took = (time.perf_counter() - began) * 1e3
        times.append(f"{took:.0f}" + (f"*{max(ran)}" if ran else ""))
    print(mode, " ".join(times))


if __name__ == "__main__":
    logging.disable(logging.CRITICAL)
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "default"))
