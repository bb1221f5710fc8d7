"""The public trainer API: `init()` then `train(...)` (re-exported by `recover.trainer`).

A user's script, started by `recover agent` (or `recover run`) as
``python train.py ARGS``, builds its model and optimizer as usual, names a
microbatch source and a loss, and hands them over::

    import recover.trainer as rt

    job = rt.init()                          # who am I, what does the job say
    model = build_model(seed=job.seed)       # identical on every replica
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    rt.train(job, model, optimizer,
             microbatches=rt.DatasetMicrobatches(dataset, microbatch_size=8),
             loss_fn=lambda model, batch: model(batch).loss)

ReCoVer owns the loop from there: which microbatches this replica computes,
the RNG seed of each, accumulation, the reduction, the commit, recovery. The
user's optimizer steps only on a committed step, so an LR scheduler stepped
by ReCoVer, clipping of the reduced gradient and `on_step_committed` see the
same values on every replica, failures or not.

Mistakes in the user's part end the worker with one line naming the problem
(and the user's own traceback when their code raised), never a hang.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recover.common import logs
from recover.common.lifetime import die_with_parent
from recover.common.progress import ProgressBeacon
from recover.proto import pb
from recover.trainer import replica as replica_ranks
from recover.trainer import sharding, standalone
from recover.trainer.buffers import BUFFER_MODES, reduced_buckets
from recover.trainer.channel import AgentChannel, ChannelClosed
from recover.trainer.checkpoint import CheckpointWriter
from recover.trainer.determinism import check_batch
from recover.trainer.determinism import check_determinism as run_determinism_check
from recover.trainer.digest import DIGEST_SCHEME
from recover.trainer.errors import WorkloadError, contract_error
from recover.trainer.executor import StepExecutor
from recover.trainer.faults import hooks_for
from recover.trainer.gradients import GradientBuckets, GradientLayoutError
from recover.trainer.groups import group_factory
from recover.trainer.lossscale import LossScale, make_scaler
from recover.trainer.memory import keep_freed_memory
from recover.trainer.overlap import piece_bytes
from recover.trainer.reduction import make_accumulator
from recover.trainer.replica import Lockstep, ReplicaBroken, ReplicaRanks
from recover.trainer.sources import as_source
from recover.trainer.statewire import StateEncodingError, encode
from recover.trainer.transfer import Listener
from recover.trainer.workload import ForwardBackwardFn, LossFn, Stateful, StepInfo, Workload

log = logging.getLogger("recover.trainer")

EXIT_WORKLOAD_ERROR = 1
EXIT_NOT_LAUNCHED = 2
EXIT_AGENT_GONE = 3


@dataclass(frozen=True)
class Job:
    """What this worker is and what the job says; returned by `init()`."""

    job_id: str
    replica: int
    """This replica's id (stable for its life; ids of lost replicas are not reused)."""
    replicas: int
    """Replicas the job started with."""
    steps: int
    """Optimizer steps the job trains."""
    global_microbatches: int
    """M: microbatches every step sums, whatever fails."""
    seed: int
    """The job's seed: build the model from it so every replica starts identical."""
    reduce: str
    """"fast" or "exact" (bitwise identical to the failure-free run)."""
    config: Mapping[str, Any]
    """The job file's [workload.config] table (empty without one): the workload's own settings."""
    device: torch.device
    """Where this replica's model should live: its slot's GPU when there is one, else the CPU."""
    replica_rank: int = 0
    """Rank within the replica (0 .. replica_size-1)."""
    replica_size: int = 1
    """Processes (ranks) per replica: `--ranks-per-replica`, 1 by default."""
    replica_mesh: Any = None
    """With several ranks per replica: a 1-D DeviceMesh over them, to shard the model on
    (``fully_shard(module, mesh=job.replica_mesh)``); None for one-process replicas."""
    replica_group: Any = None
    """With several ranks per replica: their process group (torch's default group here; it
    never spans replicas). None for one-process replicas."""
    _channel: AgentChannel | None = field(default=None, repr=False, compare=False)
    _ranks: ReplicaRanks | None = field(default=None, repr=False, compare=False)
    _proto: pb.JobConfig | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class TrainResult:
    """How the job ended, as this replica saw it."""

    success: bool
    reason: str
    steps_applied: int
    """Steps this replica applied (all of them unless it was lost)."""
    is_first_replica: bool = False
    """This replica was the first member at the last committed step: exactly one replica of
    a job that succeeded is, so save the final model where this is true (a job with
    `--checkpoint-dir` also writes a checkpoint of its last step)."""


_job: Job | None = None


def _exit(code: int, message: str) -> None:
    print(f"recover: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _die_with_agent() -> bool:
    """SIGKILL this worker when its parent dies, so a lost host loses its workers too.

    The parent is the agent, or a wrapper between them (`-- ./train.sh`, `uv run`),
    whose whole process group the agent kills; either way the agent's channel
    closing stops a worker too. Returns False when the agent is already gone.
    """
    if os.environ.get("RECOVER_ATTACHED") == "1":
        return True  # the single-process mode: our parent is the user's shell, not an agent
    agent_pid = os.environ.get("RECOVER_AGENT_PID", "")
    return die_with_parent(int(agent_pid) if agent_pid.isdigit() else None)


def _device(slot: int) -> torch.device:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", slot % torch.cuda.device_count())
    return torch.device("cpu")


def init() -> Job:
    """Attach to this worker's agent and return the job. Call it once, before building
    the model; a second call returns the same Job.

    Started outside ReCoVer (no agent), it prints one line and exits with code 2.
    """
    global _job
    if _job is not None:
        return _job
    if "RECOVER_REPLICA_ID" not in os.environ and standalone.enabled():
        try:
            standalone.attach()
        except standalone.NotStandalone as exc:
            _exit(EXIT_NOT_LAUNCHED, f"recover.trainer.init(): {exc}")
    try:
        replica = int(os.environ["RECOVER_REPLICA_ID"])
        address = os.environ["RECOVER_AGENT_ADDR"]
        slot = int(os.environ.get("RECOVER_SLOT", "0"))
    except (KeyError, ValueError):
        _exit(EXIT_NOT_LAUNCHED, "recover.trainer.init(): this script must be started by "
              "`recover run ... -- python SCRIPT` or `recover agent` (RECOVER_REPLICA_ID and "
              "RECOVER_AGENT_ADDR are not set; RECOVER_STANDALONE=0 turns off training here as "
              "one local replica)")
    logs.configure("worker")
    log.info("%s", keep_freed_memory(), extra={"replica": replica})
    if not _die_with_agent():
        _exit(EXIT_AGENT_GONE, "the agent exited before this worker started")
    rank, size = replica_ranks.from_environment()
    channel = AgentChannel(address, replica, rank=rank)
    try:
        welcome = channel.connect()
    except ChannelClosed as exc:
        _exit(EXIT_AGENT_GONE, f"replica {replica}: {exc}")
    ranks = None
    if size > 1:
        if rank:
            channel.follow_only()
        store = os.environ.get("RECOVER_REPLICA_STORE", "")
        if not store:
            _exit(EXIT_NOT_LAUNCHED, "recover.trainer.init(): RECOVER_REPLICA_STORE is not set "
                  "for a replica of several ranks")
        ranks = replica_ranks.join_replica(rank, size, store, replica)
    proto = welcome.job
    try:
        config = json.loads(proto.workload.config_json) if proto.workload.config_json else {}
    except json.JSONDecodeError:
        config = {}
    _job = Job(job_id=proto.job_id, replica=replica, replicas=proto.replicas, steps=proto.steps,
               global_microbatches=proto.global_microbatches, seed=proto.seed,
               reduce=proto.reduce or "fast", config=config, device=_device(slot),
               replica_rank=rank, replica_size=size,
               replica_mesh=ranks.mesh if ranks else None,
               replica_group=ranks.group if ranks else None,
               _channel=channel, _proto=proto, _ranks=ranks)
    return _job


def train(job: Job, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
          microbatches: Any,
          loss_fn: LossFn | None = None,
          forward_backward: ForwardBackwardFn | None = None,
          lr_scheduler: Any = None,
          max_grad_norm: float | None = None,
          on_step_committed: Callable[[StepInfo], None] | None = None,
          extra_state: Mapping[str, Stateful] | None = None,
          check_determinism: bool | None = None,
          buffers: str = "reduce",
          loss_scale: LossScale | None = None) -> TrainResult:
    """Train `model` under ReCoVer until the job ends; returns how it ended.

    microbatches: a function ``(step, microbatch) -> batch`` (deterministic), or a
        ``DatasetMicrobatches(dataset, microbatch_size=B)``, or any ``MicrobatchSource``.
    loss_fn: ``(model, batch) -> loss`` (a scalar tensor), or ``-> (loss, tokens)`` to
        report tokens; ReCoVer calls ``backward()``.
    forward_backward: instead of loss_fn, for code that runs its own backward (a
        pipeline schedule, several losses): ``(model, batch) -> loss`` as a float or tensor.
    lr_scheduler: stepped once per *committed* step, after the optimizer.
    max_grad_norm: clip the reduced gradient to this global norm before the optimizer step.
    on_step_committed: called with a ``StepInfo`` after every committed step, on every
        replica (``info.is_first_replica`` is true on exactly one: log there).
    extra_state: name -> object with ``state_dict()``/``load_state_dict()`` that joins and
        restores carry along with the model, optimizer and scheduler.
    check_determinism: compute microbatch 0 twice before training and compare bitwise
        (default: the job's setting, on in exact mode; otherwise microbatch 0's batch is
        still loaded twice and compared, unless the job says --no-check-determinism);
        False skips both.
    buffers: the model's buffers (BatchNorm statistics, ...). "reduce" (default): every
        microbatch's forward starts from the committed buffers and the step commits the mean
        of their updates, reduced like gradients (exactly in exact mode), so buffers are in
        the guarantee and the step digests. "local": each replica keeps its own (outside the
        guarantee; a warning says so). A model without buffers is the same either way.
    loss_scale: dynamic loss scaling for float16 autocast, in place of a GradScaler
        (``rt.LossScale()``: GradScaler's defaults). The loss is multiplied by the scale
        before backward; a step whose *reduced* gradient is not finite is skipped on every
        replica and the scale halves; after ``growth_interval`` finite steps it doubles.
        Needs ``loss_fn``, float32 (or float64) parameters, one rank per replica.
    """
    if job._channel is None or job._proto is None:
        raise TypeError("train() needs the Job returned by recover.trainer.init()")
    channel, proto = job._channel, job._proto
    executor: StepExecutor | None = None
    beacon: ProgressBeacon | None = None
    # Where a donor's state arrives if this replica joins a running job (a restart, a
    # replacement host, a spare): the address on the agent's route to the controller.
    listener = Listener(os.environ.get("RECOVER_TRANSFER_HOST", "127.0.0.1"),
                        tls=os.environ.get("RECOVER_TRANSFER_TLS") == "1")
    try:
        workload = _workload(job, model, optimizer, microbatches, loss_fn, forward_backward,
                             lr_scheduler, max_grad_norm, on_step_committed, extra_state, buffers,
                             loss_scale)
        lockstep = Lockstep(job._ranks) if job._ranks is not None else None
        if lockstep is not None:
            sharding.prepare(workload, lockstep, exact=job.reduce == "exact")
        if workload.buffer_warning and job.replica == 0:
            log.warning("%s", workload.buffer_warning, extra={"replica": job.replica})
        try:
            grads = GradientBuckets(workload.params)
            reduced = reduced_buckets(grads, workload.model_buffers)
            groups = group_factory(proto.group_backend, [b.device for b in reduced.buckets])
            accumulator = make_accumulator(
                job.reduce, reduced, job.global_microbatches, proto.reduce_dtype or "grad",
                loss_scaled_buckets=len(grads.buckets) if workload.loss_scaler else 0,
                loss_scale=workload.loss_scaler.scale if workload.loss_scaler else 1.0,
                piece_bytes=piece_bytes(job.reduce, proto.reduce_after_backward,
                                        workload.forward_backward is not None,
                                        max(job.replica_size, 1), proto.testing.overlap_piece_bytes))
        except (GradientLayoutError, ValueError) as exc:
            raise contract_error(str(exc), where="train") from None
        progress_file = os.environ.get("RECOVER_PROGRESS_FILE")
        beacon = ProgressBeacon(Path(progress_file)) if progress_file else None
        info = pb.WorkloadInfo(parameters=sum(p.numel() for p in workload.params),
                               gradient_buckets=grads.describe(),
                               samples_per_microbatch=workload.source.samples_per_microbatch or 0,
                               digest_scheme=DIGEST_SCHEME,
                               reduce_pieces=len(accumulator.pieces))
        first_step = proto.resume.step if proto.resume.path else 0
        hooks = hooks_for(proto.testing, job.replica, channel.note_fault,
                          beacon.mark_killed if beacon is not None else None, job.replica_rank)
        executor = StepExecutor(proto, job.replica, channel, workload, grads, accumulator,
                                first_step=first_step, beacon=beacon, listener=listener,
                                hooks=hooks, groups=groups)
        executor.lockstep = lockstep
        if proto.resume.path:
            executor.resume = proto.resume  # loaded at the first generation, if no donor's first
        _check_state_travels(executor)  # each rank its own part (a shard travels as such)
        wanted = proto.check_determinism if check_determinism is None else check_determinism
        if not wanted and check_determinism is None and not proto.skip_batch_check:
            check_batch(workload)  # fast mode: the same microbatches, if not the same bits
        if wanted:  # on the model as built: every replica, joiners too, checks the same thing
            checked = run_determinism_check(workload, grads, step=0)
            info.determinism_sha256 = checked.gradient_sha256 if lockstep is None \
                else lockstep.combine_digest(checked.gradient_sha256)
            log.info("determinism check passed (gradient %s)", checked.gradient_sha256[:12],
                     extra={"replica": job.replica})
        if proto.checkpoint.dir:
            executor.checkpoints = CheckpointWriter(
                proto.checkpoint, proto, job.replica,
                lambda written: channel.send(pb.WorkerReport(checkpoint_written=written)),
                first_step, rank=job.replica_rank, ranks=job.replica_size)
        # Every rank's transfer address, in rank order: donor rank k streams to rank k.
        address, pin = listener.address, listener.tls_sha256
        if lockstep is not None:
            address, pin = (",".join(lockstep.gather_text(x)) for x in (address, pin))
        shutdown = executor.run(pb.Ready(param_sha256=workload.digest(), pid=os.getpid(),
                                         workload=info, transfer_address=address,
                                         transfer_tls_sha256=pin if listener.tls_sha256 else ""))
    except WorkloadError as exc:
        _report_and_exit(channel, exc)
    except ChannelClosed as exc:
        _exit(EXIT_AGENT_GONE, f"replica {job.replica} stopping: {exc}")
    except ReplicaBroken as exc:  # a sibling rank died: the agent is ending this replica
        _exit(EXIT_AGENT_GONE, f"replica {job.replica} rank {job.replica_rank} stopping: {exc}")
    finally:
        if executor is not None and executor.checkpoints is not None:
            executor.checkpoints.close()
        if beacon is not None:
            beacon.close()
        listener.close()
        channel.close()
    log.info("job ended: %s", shutdown.reason, extra={"replica": job.replica})
    standalone.finish()  # the single-process mode: the summary is written when train() returns
    return TrainResult(shutdown.success, shutdown.reason, executor.steps_applied,
                       executor.first_at_last_commit)


def _check_state_travels(executor: StepExecutor) -> None:
    """A state that cannot be sent would crash every donor and checkpoint writer later:
    say so now, naming the piece (e.g. an extra_state value of a type ReCoVer cannot send)."""
    try:
        encode(executor.training_state(), check_only=True)
    except StateEncodingError as exc:
        raise contract_error(f"the training state cannot be transferred or checkpointed: {exc}",
                             where="extra_state") from None


def _report_and_exit(channel: AgentChannel, exc: WorkloadError) -> None:
    channel.report_error(exc.report())
    if exc.user_traceback:
        print(exc.user_traceback.rstrip(), file=sys.stderr)
    _exit(EXIT_WORKLOAD_ERROR, str(exc))


def _workload(job: Job, model: Any, optimizer: Any, microbatches: Any, loss_fn: Any,
              forward_backward: Any, lr_scheduler: Any, max_grad_norm: Any,
              on_step_committed: Any, extra_state: Any, buffers: Any = "reduce",
              loss_scale: Any = None) -> Workload:
    """Check the arguments of train(); a mistake is a contract error naming it."""

    def bad(message: str) -> WorkloadError:
        return contract_error(f"train(): {message}", where="train")

    if not isinstance(model, torch.nn.Module):
        raise bad(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise bad(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if (loss_fn is None) == (forward_backward is None):
        raise bad("give exactly one of loss_fn (ReCoVer calls backward) and forward_backward "
                  "(your function does)")
    for name, fn in (("loss_fn", loss_fn), ("forward_backward", forward_backward),
                     ("on_step_committed", on_step_committed)):
        if fn is not None and not callable(fn):
            raise bad(f"{name} must be a function, got {type(fn).__name__}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(
            max_grad_norm, int | float) or not 0 < max_grad_norm < math.inf):
        raise bad(f"max_grad_norm must be a positive number, got {max_grad_norm!r}")
    if lr_scheduler is not None and not all(hasattr(lr_scheduler, a) for a in
                                            ("step", "state_dict", "load_state_dict")):
        raise bad(f"lr_scheduler must have step(), state_dict() and load_state_dict(), got "
                  f"{type(lr_scheduler).__name__}")
    if buffers not in BUFFER_MODES:
        raise bad(f"buffers must be one of {', '.join(map(repr, BUFFER_MODES))}, got {buffers!r}")
    try:
        scaler = None if loss_scale is None else make_scaler(
            loss_scale, model, has_loss_fn=loss_fn is not None, sharded=job._ranks is not None)
    except ValueError as exc:
        raise bad(f"loss_scale: {exc}") from None
    extra = dict(extra_state or {})
    for name, obj in extra.items():
        if not isinstance(name, str) or not isinstance(obj, Stateful):
            raise bad(f"extra_state[{name!r}] must be an object with state_dict() and "
                      "load_state_dict()")
    try:
        source = as_source(microbatches)
        source.bind(job.global_microbatches, job.seed)
    except (TypeError, ValueError) as exc:
        raise bad(str(exc)) from None
    return Workload(model=model, optimizer=optimizer, source=source, seed=job.seed,
                    loss_fn=loss_fn, forward_backward=forward_backward, lr_scheduler=lr_scheduler,
                    max_grad_norm=None if max_grad_norm is None else float(max_grad_norm),
                    on_step_committed=on_step_committed, extra_state=extra, buffers=buffers,
                    loss_scaler=scaler)
