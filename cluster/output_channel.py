"""The leader's end of one ingress channel: queue outputs, push them out in batches.

Everything queued while the previous batch was being sent goes out as the next batch, so an
engine step's outputs for all of this ingress's requests travel as one message, and nothing
ever waits to fill a batch.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from flotilla.cluster.contract import EngineErrorKind, GroupEngineError, WireOutput, encode_outputs

logger = logging.getLogger(__name__)
SEND_HIGH_WATER_MARK = 100_000  # batches queued for a slow ingress before we give up on it


class OutputChannel:
    def __init__(self, channel_id: str, address: str) -> None:
        self.channel_id = channel_id
        self.address = address
        self.requests: dict[str, asyncio.Task[None]] = {}
        self._outbox: asyncio.Queue[WireOutput] = asyncio.Queue()
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._sender = asyncio.create_task(self._send_forever())

    def put(self, output: WireOutput) -> None:
        self._outbox.put_nowait(output)

    def fail(self, key: str, kind: EngineErrorKind, message: str) -> None:
        self.put(WireOutput.failed(key, GroupEngineError(kind, message)))

    async def closed(self) -> None:
        """Returns when the channel stops on its own (the ingress stopped reading)."""
        await asyncio.shield(self._sender)

    def close(self) -> None:
        self._sender.cancel()
        for task in self.requests.values():
            task.cancel()
        self._socket.close()

    async def _send_forever(self) -> None:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            try:
                await self._socket.send(_encode(batch), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("ingress channel %s is not reading; dropping it", self.channel_id)
                return


def _encode(batch: list[WireOutput]) -> bytes:
    """The batch, with any output that cannot be encoded replaced by its request's error (never a dead channel)."""
    try:
        return encode_outputs(batch)
    except (TypeError, ValueError, OverflowError):
        return encode_outputs([_encodable(output) for output in batch])


def _encodable(output: WireOutput) -> WireOutput:
    try:
        encode_outputs([output])
        return output
    except (TypeError, ValueError, OverflowError) as err:
        logger.exception("output of request %s cannot be sent", output.request_id)
        return WireOutput.failed(output.key, GroupEngineError(EngineErrorKind.INTERNAL, f"unsendable output: {err}"))
