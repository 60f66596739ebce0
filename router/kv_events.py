"""Follow one group's vLLM KV events (ZMQ) and keep the prefix index exact for that group.

vLLM's publisher sends ``(topic, seq, payload)`` where the payload is a msgpack
``[ts, events, dp_rank]`` batch of tagged events. On connect the feed first replays the
publisher's buffer (its ROUTER replay socket), so a late ingress starts with what the engine
already caches; a gap in sequence numbers is filled the same way. While events flow, the
group is matched precisely; when the feed breaks, the group falls back to the router's own
(approximate) knowledge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from flotilla.router.prefix_index import STORED, PrefixIndex

logger = logging.getLogger(__name__)
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 5.0


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(EventBatch).decode


class KvEventFeed:
    def __init__(
        self,
        group: str,
        endpoint: str,
        replay_endpoint: str | None,
        index: PrefixIndex,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.group = group
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.index = index
        self.on_event = on_event
        self.last_seq = -1
        self.applied_batches = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.index.has_group(self.group):
            self.index.set_precise(self.group, False)

    async def _run(self) -> None:
        context = zmq.asyncio.Context.instance()
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        subscriber.connect(self.endpoint)
        try:
            await self._replay(context, 0)
            self.index.set_precise(self.group, True)
            while True:
                _, seq_bytes, payload = await subscriber.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq <= self.last_seq:
                    continue  # already applied from a replay
                if seq > self.last_seq + 1 and self.replay_endpoint:
                    await self._replay(context, self.last_seq + 1)
                    if seq <= self.last_seq:
                        continue
                self._apply(seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("KV event feed of %s broke; routing it on the router's own knowledge", self.group)
            self.index.set_precise(self.group, False)
        finally:
            subscriber.close()

    async def _replay(self, context: zmq.asyncio.Context, start_seq: int) -> None:
        """Ask the publisher for every buffered batch from ``start_seq`` on."""
        if not self.replay_endpoint:
            return
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                _, _, seq_bytes, payload = frames
                if seq_bytes == END_OF_REPLAY:
                    return
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq:
                    self._apply(seq, payload)
        finally:
            dealer.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.applied_batches += 1
        for event in _decode_batch(payload).events:
            if isinstance(event, BlockStored):
                self.index.record_stored(self.group, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.index.record_removed(self.group, event.block_hashes)
            else:
                self.index.clear(self.group, STORED)
        if self.on_event is not None:
            self.on_event(self.group)
