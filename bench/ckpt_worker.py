"""One worker of the checkpoint-and-restart baseline (torchrun-style elastic training).

    python -m recover.bench.ckpt_worker CONFIG.json RANK WORLD_SIZE PORT

Plain torch.distributed: a gloo process group over a TCP rendezvous hosted by
rank 0, the same reference GPT, synthetic data, M, microbatch size, AdamW and
`--compute-ms` emulation as a ReCoVer worker (bench/reference_model.py), and
no fault tolerance at all: a dead peer makes the allreduce raise and the worker
exits non-zero; the supervisor (bench/ckpt_restart.py) then restarts every
worker, which resume from the newest checkpoint. Everything a restart costs is
real here: process start, `import torch`, the gloo rendezvous and the checkpoint
load.

Rank 0 writes the checkpoints (model, optimizer, next step = the data position:
microbatch i of step t is a pure function of (seed, t, i)) atomically, on the
interval chosen by `checkpoint_due` (Young-Daly, or a fixed interval).
Progress goes to an events file, one JSON object per line, read by the supervisor.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import sys
import time

STARTED = time.time()

import torch  # noqa: E402  (imported after STARTED: its import time is a restart cost)
import torch.distributed as dist  # noqa: E402

from recover.bench.ckpt_policy import CheckpointPolicy, checkpoint_due  # noqa: E402
from recover.bench.reference import reference_config, tokens_per_step  # noqa: E402
from recover.bench.reference_model import ReferenceGPT  # noqa: E402
from recover.proto import pb  # noqa: E402
from recover.trainer.gradients import GradientBuckets  # noqa: E402
from recover.trainer.reduction import make_accumulator  # noqa: E402

IMPORTED = time.time()


def my_microbatches(rank: int, world: int, total: int) -> list[int]:
    """Contiguous, near-equal blocks (the same split as a uniform ReCoVer plan)."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return list(range(start, start + base + (1 if rank < extra else 0)))


class Events:
    """Appends one JSON line per event with a single O_APPEND write (atomic between ranks)."""

    def __init__(self, path: str, rank: int) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._rank = rank

    def emit(self, kind: str, **fields: object) -> None:
        line = json.dumps({"event": kind, "rank": self._rank, "at": time.time(), **fields})
        os.write(self._fd, (line + "\n").encode())


def main(argv: list[str]) -> int:
    config_path, rank, world, port = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    with open(config_path) as f:
        config = json.load(f)
    job = pb.JobConfig()
    job.ParseFromString(bytes.fromhex(config["job_hex"]))
    policy = CheckpointPolicy(**config["policy"])
    ckpt_path = config["checkpoint"]
    events = Events(config["events"], rank)
    torch.set_num_threads(1)  # as ReCoVer's workers: results must not depend on the core count

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    rendezvous = time.time()
    gpt = ReferenceGPT.build(reference_config(job, "the ckpt-restart baseline"), job.seed,
                             job.global_microbatches)
    model, optimizer = gpt.model, gpt.optimizer
    workload = gpt.workload()
    start_step, loaded_s = 0, 0.0
    if os.path.exists(ckpt_path):
        t = time.perf_counter()
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = int(state["next_step"])
        loaded_s = time.perf_counter() - t
    events.emit("ready", step=start_step, process_start=STARTED, import_s=IMPORTED - STARTED,
                rendezvous_s=rendezvous - IMPORTED, load_s=loaded_s, world=world)

    params = [p for p in model.parameters() if p.requires_grad]
    grads = GradientBuckets(params)
    accumulator = make_accumulator("fast", grads, job.global_microbatches,
                                   job.reduce_dtype or "grad")
    mine = my_microbatches(rank, world, job.global_microbatches)
    tokens = tokens_per_step(job, gpt.config)
    compute_ms = job.testing.compute_ms
    write_cost = math.nan  # unknown until the first checkpoint is written
    last_ckpt = time.monotonic()
    slot = config["slots"][rank]
    self_kills = {(step, s) for step, s in config.get("self_kills", []) if s == slot}
    for step in range(start_step, job.steps):
        if (step, slot) in self_kills:
            events.emit("kill", step=step, slot=slot)  # before dying: the supervisor reads it
            os.kill(os.getpid(), signal.SIGKILL)
        accumulator.reset()
        for mb in mine:
            accumulator.before_microbatch()
            result = workload.compute(step, mb)  # what ReCoVer's workers run
            if compute_ms > 0:
                time.sleep(compute_ms / 1000.0)  # emulated accelerator time, as in ReCoVer
            accumulator.after_microbatch(result.loss)
        buffers = accumulator.buffers()  # one per gradient bucket, the step's stats in the last
        for buffer in buffers:
            dist.all_reduce(buffer)
        reduced = accumulator.finish(buffers)
        workload.apply(grads, reduced.grads)
        if rank != 0:
            continue
        events.emit("step", step=step, loss=reduced.loss, tokens=tokens)
        due, reason = checkpoint_due(policy, step + 1, time.monotonic() - last_ckpt, write_cost)
        if due and step + 1 < job.steps:
            t = time.perf_counter()
            tmp = ckpt_path + ".tmp"
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "next_step": step + 1}, tmp)
            os.replace(tmp, ckpt_path)  # atomic: a crash mid-write leaves the previous one
            write_cost = time.perf_counter() - t
            last_ckpt = time.monotonic()
            events.emit("checkpoint", step=step + 1, write_s=write_cost, reason=reason)
    dist.destroy_process_group()
    events.emit("done", step=job.steps)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # As bench/ddp_worker.py: skip C++ static destructors. gloo/TCPStore threads racing
    # them at interpreter exit sometimes abort ("terminate called without an active
    # exception", seen once in a suite run), after "done", and the supervisor took
    # that exit for a failure and restarted a finished failure-free run.
    os._exit(code)
