"""A step's commit as a transition (DESIGN.md, layer 2).

A step commits only when every member of the current generation reported "step t
reduced in generation g"; its record, and the plan the workers will hold next, are
stored *before* the members are told to apply it. The step boundary is also where
operators' stops and drains take effect and where joiners enter.
"""

from __future__ import annotations

import logging

from recover.controller import effects, joinflow, policy, reports
from recover.controller.jobstate import plan_message, step_record
from recover.controller.losses import members_lost
from recover.controller.operations import finish_drains, leaving_at_boundary
from recover.controller.transitions import broadcast, fail, maybe_finish, new_generation
from recover.controller.view import Draft
from recover.proto import pb


def commit(d: Draft, reported: list[pb.Reduced]) -> None:
    """Every member reduced the step in flight (`reported`, in the members' order)."""
    v = d.v
    if any(r.overflow for r in reported):
        _redo_overflowed_step(d, reported)
        return
    members = list(v.members)
    job = v.job
    assignment = {m: tuple(r.microbatch_ids) for m, r in zip(members, reported, strict=True)}
    problem = policy.check_plan(assignment, job.global_microbatches,
                                d.policy.expected(v.plan, job.global_microbatches))
    if problem is not None:
        fail(d, f"refusing to commit step {v.step}: {problem}")
        return
    verdict = reports.agree_on_loss({m: r.loss for m, r in zip(members, reported, strict=True)})
    if verdict.reason:
        d.emit("loss-mismatch", verdict.reason, step=v.step, generation=v.generation,
               level=logging.WARNING)
    if verdict.outliers:  # the step is reduced again without them, in the next generation
        members_lost(d, list(verdict.outliers), verdict.reason, cause="refused")
        return
    record = step_record(job, v.step, v.generation, members, reported, d.now,
                         loss=verdict.loss)
    record.failures.extend(d.facts.unrecorded_failures)
    record.stolen = v.stolen
    next_step = v.step + 1
    final = next_step >= job.steps
    stop = bool(v.stopping) and not final
    entering = [] if stop else joinflow.entering(d, next_step, final=final)
    leaving = [] if final or stop else leaving_at_boundary(d)
    # The plan the workers will hold next goes with the commit, and into the store with
    # it: a new leader resumes from it, never from a plan it re-derives. None when the
    # membership changes at the boundary: the next generation plans the step then.
    decision = None if final or stop or entering or leaving else \
        d.policy.plan(members, job.global_microbatches)
    next_plan = None if decision is None else \
        plan_message(next_step, v.generation, 0, decision, open_shares=job.work_stealing)
    # Durable before anyone applies: a new leader must know this step committed. The
    # previous record rides along in the same write with the parameter digests its
    # members reported since (no extra round trip per step).
    d.do(effects.CommitStep(record, next_plan))
    d.ledger_len += 1
    d.applied_last = set()
    d.set(step=next_step, scale_epoch=0, plan_version=0, stolen=0)
    commit_msg = pb.Commit(step=v.step, generation=v.generation, final=final,
                           microbatches=record.microbatches, tokens=record.tokens,
                           record=record)
    commit_msg.record.ClearField("sample_ids")  # the digest is the ledger entry workers keep
    if decision is not None and next_plan is not None:
        d.set(plan=decision.assignment)
        commit_msg.next_plan.CopyFrom(next_plan)
    commit_msg.checkpoint_now = stop
    broadcast(d, pb.ControllerMessage(commit=commit_msg))
    if stop:  # ends once every member acknowledged this step (its digests in the summary)
        d.set(stop_pending=True)
        maybe_finish(d)
        return
    if leaving:
        finish_drains(d)
    if entering or leaving:  # joiners enter, drained members leave at the step boundary
        new_members = sorted({*members, *entering} - set(leaving))
        new_generation(d, new_members, d.policy.plan(new_members, job.global_microbatches))


def _redo_overflowed_step(d: Draft, reported: list[pb.Reduced]) -> None:
    """Exact reduction overflowed its predicted scale: redo the step at a lower one.

    A new generation (same members, same plan, next scale epoch) rather than a side
    message: it reuses fencing, so a member whose allreduce failed while others saw the
    overflow cannot end up on a different scale.
    """
    overflowed = max(r.overflow for r in reported)
    redo = policy.overflow_redo(d.v.step, d.v.scale_epoch, overflowed)
    if not redo.redo:
        fail(d, redo.reason)
        return
    d.set(scale_epoch=redo.scale_epoch, redos=d.v.redos + 1)
    new_generation(d, list(d.v.members), policy.PlanDecision(dict(d.v.plan), redo.reason))
