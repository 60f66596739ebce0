"""The ingress end of one group: submit requests, demultiplex the group's output batches.

Per (ingress replica, group) there is one ZeroMQ PULL socket on this node; the leader pushes
msgpack batches of :class:`RequestOutput` to it, and a pump task hands each chunk to its
request's queue. Requests are submitted with plain Ray actor calls, and one call held open for
the channel's life (``attach``) fails when the leader dies, which fails every waiting request
at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import ray
import zmq
import zmq.asyncio

from cluster.group_api import (
    EngineErrorKind,
    GenerateChunk,
    GenerateRequest,
    GroupEngineError,
    RequestOutput,
    decode_outputs,
)


class GroupChannel:
    def __init__(self, leader: Any, host: str) -> None:
        self.leader = leader  # ActorHandle of cluster.leader.GroupLeader
        self.channel_id = uuid.uuid4().hex
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        port = self._socket.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateChunk, None]:
        """Chunks of ``request`` until its final one; leaving early aborts it in the engine."""
        self._ensure_started()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            await self.leader.submit.remote(self.channel_id, self.address, request)
            while not finished:
                output = await queue.get()
                error = output.error()
                if error is not None:
                    finished = True
                    raise error
                assert output.chunk is not None
                finished = output.chunk.finish_reason is not None
                yield output.chunk
        finally:
            del self._queues[request.request_id]
            if not finished:
                self.leader.abort.remote(request.request_id)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._socket.close()

    def _ensure_started(self) -> None:
        if not self._tasks or any(task.done() for task in self._tasks):
            for task in self._tasks:
                task.cancel()
            self._tasks = [asyncio.create_task(self._pump()), asyncio.create_task(self._watch_leader())]

    async def _pump(self) -> None:
        while True:
            for output in decode_outputs(await self._socket.recv()):
                queue = self._queues.get(output.request_id)
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
        error = GroupEngineError(EngineErrorKind.ENGINE_DEAD, failure)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(RequestOutput.failed(request_id, error))
