"""The ingress end of one group: submit requests, demultiplex the group's output batches.

Per (ingress replica, group) there is one ZeroMQ PULL socket on this node; the leader pushes
msgpack batches of :class:`WireOutput` to it, and a pump task hands each output to its
request's queue. Requests and aborts are pushed to the leader's inbox (``cluster.request_inbox``),
and one Ray call held open for the channel's life (``attach``) fails when the leader dies, which
fails every waiting request at once: no request waits on a group that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import ray
import zmq
import zmq.asyncio

from flotilla.cluster.contract import (
    EngineErrorKind,
    GroupEngineError,
    WireOutput,
    decode_outputs,
    encode_abort,
    encode_submission,
)

logger = logging.getLogger(__name__)


class GroupChannel:
    def __init__(self, leader: Any, host: str, inbox_endpoint: str) -> None:
        self.leader = leader  # ActorHandle of cluster.leader.GroupLeader
        self.channel_id = uuid.uuid4().hex
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        # A plain socket: a non-blocking send needs no event loop, and an asyncio one costs a future per send.
        self._inbox: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.connect(inbox_endpoint)
        self._queues: dict[str, asyncio.Queue[WireOutput]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    async def stream(self, request: Any, key: str) -> AsyncGenerator[WireOutput, None]:
        """Outputs of ``request`` (an ``EngineCoreRequest``) until its last; leaving early aborts it in the engine.

        ``key`` names this attempt on the channel (unique; the leader's ``abort`` takes it too).
        Raises :class:`GroupEngineError` when the group fails or rejects the request.
        """
        self._ensure_started()
        queue: asyncio.Queue[WireOutput] = asyncio.Queue()
        self._queues[key] = queue
        finished = False
        try:
            self._send(encode_submission(self.channel_id, self.address, key, request))
            while not finished:
                output = await queue.get()
                finished = output.finished
                error = output.error()
                if error is not None:
                    raise error
                yield output
        finally:
            del self._queues[key]
            if not finished:
                self.abort(key)

    def abort(self, key: str) -> None:
        """Stop the request ``key`` in the group (nothing happens where it already ended)."""
        try:
            self._send(encode_abort(key))
        except GroupEngineError:
            pass  # a leader that takes nothing has no request to stop; its attach call ends the channel

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._socket.close()
        self._inbox.close()

    def _send(self, frames: list[Any]) -> None:
        try:
            self._inbox.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # its high-water mark of queued messages is full: the leader is not reading
            raise GroupEngineError(EngineErrorKind.ENGINE_DEAD, "the group is not taking requests") from None

    def _ensure_started(self) -> None:
        if not self._tasks or any(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._watch_leader())]

    async def _pump(self) -> None:
        while True:
            payload = await self._socket.recv()
            try:
                outputs = decode_outputs(payload)
            except Exception as err:  # not our leader's format: nothing on this channel can be trusted to finish
                logger.error("undecodable message on the channel to %s: %s", self.address, err)
                self._fail_all(f"undecodable output message: {err}")
                continue
            for output in outputs:
                queue = self._queues.get(output.key)
                if queue is not None:
                    queue.put_nowait(output)

    async def _watch_leader(self) -> None:
        attached = self.leader.attach.remote(self.channel_id, self.address)
        try:
            await attached
            failure = "the group closed this ingress's channel"
        except asyncio.CancelledError:
            ray.cancel(attached)  # the leader drops the channel and aborts its requests
            raise
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
        self._fail_all(failure)

    def _fail_all(self, message: str) -> None:
        error = GroupEngineError(EngineErrorKind.ENGINE_DEAD, message)
        for key, queue in list(self._queues.items()):
            queue.put_nowait(WireOutput.failed(key, error))
