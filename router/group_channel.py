"""The ingress end of one group: submit requests, demultiplex the group's output stream.

Each ingress replica opens one long-lived ``outputs`` stream per group leader and submits
requests with plain actor calls. The leader sends, as one Ray object, every chunk ready at
that moment for this ingress's requests; a pump task here hands each chunk to its request's
queue. A broken stream (leader died) fails every waiting request at once.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.group_api import EngineErrorKind, GenerateChunk, GenerateRequest, GroupEngineError, RequestOutput


class GroupChannel:
    def __init__(self, leader: Any, channel_id: str | None = None) -> None:
        self.leader = leader  # ActorHandle of cluster.leader.GroupLeader
        self.channel_id = channel_id or uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._pump: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return len(self._queues)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Chunks of ``request`` until its final one; leaving early aborts it in the engine."""
        self._ensure_pump()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            await self.leader.submit.remote(self.channel_id, request)
            while not finished:
                output = await queue.get()
                if output.error is not None:
                    finished = True
                    raise output.error
                assert output.chunk is not None
                finished = output.chunk.finish_reason is not None
                yield output.chunk
        finally:
            del self._queues[request.request_id]
            if not finished:
                self.leader.abort.remote(request.request_id)

    def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.create_task(self._run_pump())

    async def _run_pump(self) -> None:
        try:
            stream = self.leader.outputs.options(num_returns="streaming").remote(self.channel_id)
            async for ref in stream:
                for output in await ref:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
            failure = "the group's output stream ended"
        except asyncio.CancelledError:
            raise
        except Exception as err:
            failure = f"{type(err).__name__}: {err}"
        error = GroupEngineError(EngineErrorKind.ENGINE_DEAD, failure)
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(RequestOutput(request_id, error=error))
