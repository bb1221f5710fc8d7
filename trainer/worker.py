"""The reference GPT workload: `python -m recover.trainer.worker`, started by `recover agent`.

It reads its identity from RECOVER_* variables, gets the job from its agent,
and trains the tiny GPT on the synthetic corpus under the step executor.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from pathlib import Path

import torch

from recover.common import logs
from recover.common.progress import ProgressBeacon
from recover.proto import pb
from recover.trainer.channel import AgentChannel, ChannelClosed
from recover.trainer.data import CorpusConfig, SyntheticCorpus
from recover.trainer.executor import StepExecutor
from recover.trainer.model import GPTConfig, build_model

log = logging.getLogger("recover.trainer")

PR_SET_PDEATHSIG = 1


def die_with_agent() -> bool:
    """SIGKILL this worker when its agent dies, so a lost host loses its workers too.

    Returns False when the agent is already gone (the signal would never come).
    """
    agent_pid = os.environ.get("RECOVER_AGENT_PID")
    if agent_pid is None or not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    return os.getppid() == int(agent_pid)


def build_workload(job: pb.JobConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, SyntheticCorpus]:
    """Model, optimizer and data of the reference workload; identical on every replica."""
    m = job.model
    model = build_model(GPTConfig(vocab_size=m.vocab_size, seq_len=m.seq_len, n_layer=m.n_layer,
                                  n_head=m.n_head, n_embd=m.n_embd, dropout=m.dropout),
                        init_seed=job.seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.learning_rate)
    corpus = SyntheticCorpus(CorpusConfig(vocab_size=m.vocab_size, seq_len=m.seq_len,
                                          corpus_seed=job.corpus_seed))
    return model, optimizer, corpus


def main() -> int:
    logs.configure("worker")
    try:
        replica = int(os.environ["RECOVER_REPLICA_ID"])
        address = os.environ["RECOVER_AGENT_ADDR"]
    except (KeyError, ValueError):
        print("recover worker: RECOVER_REPLICA_ID and RECOVER_AGENT_ADDR are not set; "
              "workers are started by `recover agent`", file=sys.stderr)
        return 2
    if not die_with_agent():
        print("recover worker: its agent exited before the worker started", file=sys.stderr)
        return 3
    # One intra-op thread: results must not depend on how many cores a host has,
    # and several workers share this machine's cores.
    torch.set_num_threads(1)
    channel = AgentChannel(address, replica)
    try:
        welcome = channel.connect()
        model, optimizer, corpus = build_workload(welcome.job)
        progress_file = os.environ.get("RECOVER_PROGRESS_FILE")
        beacon = ProgressBeacon(Path(progress_file)) if progress_file else None
        shutdown = StepExecutor(welcome.job, replica, channel, model, optimizer, corpus,
                                beacon).run()
    except ChannelClosed as exc:
        log.error("stopping: %s", exc, extra={"replica": replica})
        return 3
    finally:
        channel.close()
    log.info("job ended: %s", shutdown.reason, extra={"replica": replica})
    return 0


if __name__ == "__main__":
    sys.exit(main())
