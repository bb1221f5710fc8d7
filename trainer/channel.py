"""The worker's end of its agent's local channel.

The training loop runs on the main thread; a receiver thread drains the
stream so that a new generation can abort an in-flight collective at once
(through `on_generation`) instead of waiting for the loop to look.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from recover.proto import pb, rpc

log = logging.getLogger("recover.trainer")

REPLICA_METADATA_KEY = "recover-replica"
RANK_METADATA_KEY = "recover-rank"


class ChannelClosed(Exception):
    """The agent went away; a worker without its agent must stop."""


class AgentChannel:
    def __init__(self, address: str, replica: int,
                 on_generation: Callable[[int], None] | None = None, rank: int = 0) -> None:
        self.replica = replica
        self.rank = rank
        """Rank within a replica of several: only rank 0 reports (replica.py says why)."""
        self._on_generation = on_generation
        self._channel = grpc.insecure_channel(address)
        self._stub = rpc.WorkerChannelStub(self._channel)
        self._metadata = ((REPLICA_METADATA_KEY, str(replica)), (RANK_METADATA_KEY, str(rank)))
        self._keep_commands = True
        self._outgoing: queue.SimpleQueue[pb.WorkerReport | None] = queue.SimpleQueue()
        self._incoming: queue.SimpleQueue[pb.WorkerCommand | None] = queue.SimpleQueue()
        self._receiver: threading.Thread | None = None
        self._closing = False

    def set_generation_hook(self, hook: Callable[[int], None]) -> None:
        self._on_generation = hook

    def connect(self, timeout_s: float = 30.0) -> pb.Welcome:
        """Attach and return the agent's welcome (the job)."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ChannelClosed("the agent's local channel did not answer") from None
        responses = self._stub.Attach(self._requests(), metadata=self._metadata)
        self._receiver = threading.Thread(target=self._receive, args=(responses,),
                                          name="agent-channel", daemon=True)
        self._receiver.start()
        first = self.next_command(timeout_s)
        if first is None or first.WhichOneof("kind") != "welcome":
            raise ChannelClosed("the agent did not welcome this worker")
        return first.welcome

    def _requests(self) -> Iterator[pb.WorkerReport]:
        while (report := self._outgoing.get()) is not None:
            yield report

    def _receive(self, responses: Iterator[pb.WorkerCommand]) -> None:
        try:
            for command in responses:
                if command.WhichOneof("kind") == "generation" and self._on_generation is not None:
                    self._on_generation(command.generation.generation)
                if self._keep_commands:
                    self._incoming.put(command)
        except grpc.RpcError as exc:
            if not self._closing:  # our own close() cancels the stream: not a failure
                log.warning("agent channel failed: %s", exc.code().name)
        finally:
            self._incoming.put(None)

    def follow_only(self) -> None:
        """Ranks 1.. of a replica: commands come from rank 0 (replica.Lockstep); this
        channel still sees every generation, to abort a collective, but keeps no command."""
        self._keep_commands = False

    def send(self, report: pb.WorkerReport) -> None:
        if self.rank != 0:
            return  # rank 0 speaks for the replica, once its ranks agreed
        report.replica = self.replica
        self._outgoing.put(report)

    def next_command(self, timeout_s: float | None = None) -> pb.WorkerCommand | None:
        """Block for the next command; None on timeout. Raises ChannelClosed when the agent left."""
        try:
            command = self._incoming.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if command is None:
            self._incoming.put(None)  # keep reporting closure to later calls
            raise ChannelClosed("the agent closed the local channel")
        return command

    def poll(self) -> pb.WorkerCommand | None:
        """The next command if one is waiting."""
        try:
            command = self._incoming.get_nowait()
        except queue.Empty:
            return None
        if command is None:
            self._incoming.put(None)
            raise ChannelClosed("the agent closed the local channel")
        return command

    def note_fault(self, note: pb.FaultNote) -> None:
        """Tell the agent about a fault about to be injected (best effort, bounded)."""
        try:
            self._stub.NoteFault(note, metadata=self._metadata, timeout=1.0)
        except grpc.RpcError:
            pass

    def report_error(self, error: pb.WorkerError) -> None:
        """Tell the agent why this worker is about to exit (bounded, best effort): it rides
        on the exit report, so the controller can tell a bug from a crash."""
        try:
            self._stub.ReportError(error, metadata=self._metadata, timeout=2.0)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._closing = True
        self._outgoing.put(None)
        self._channel.close()
