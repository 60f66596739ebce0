"""The leader's end of one ingress channel: queue outputs, push them out in batches.

Everything queued while the previous batch was being sent goes out as the next batch, so an
engine step's outputs for all of this ingress's requests travel as one message, and nothing
ever waits to fill a batch.

The channel also notices its ingress dying: a killed process cannot cancel its calls, so its
requests would run to the end for nobody. ZeroMQ's socket monitor reports the ingress's end of
the TCP connection going away; if it does not come back within ``PEER_GRACE_S`` the channel
stops and aborts its requests itself (the leader's ``attach`` call for it may never have arrived:
the ingress can die between its first submission and that call).
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from flotilla.cluster.contract import EngineErrorKind, GroupEngineError, WireOutput, encode_outputs

logger = logging.getLogger(__name__)
SEND_HIGH_WATER_MARK = 100_000  # batches queued for a slow ingress before we give up on it
PEER_GRACE_S = 5.0  # a reconnect within this is a network blip, not a dead ingress


class OutputChannel:
    def __init__(self, channel_id: str, address: str) -> None:
        self.channel_id = channel_id
        self.address = address
        self.requests: dict[str, asyncio.Task[None]] = {}
        self._outbox: asyncio.Queue[WireOutput] = asyncio.Queue()
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._socket.connect(address)
        self._sender = asyncio.create_task(self._send_forever())
        self._watcher = asyncio.create_task(self._watch_peer())
        self._closed = False

    @property
    def stopped(self) -> bool:
        """It sends nothing more: the ingress went away or stopped reading (the leader opens a new one)."""
        return self._closed or self._sender.done()

    def put(self, output: WireOutput) -> None:
        self._outbox.put_nowait(output)

    def fail(self, key: str, kind: EngineErrorKind, message: str) -> None:
        self.put(WireOutput.failed(key, GroupEngineError(kind, message)))

    async def closed(self) -> None:
        """Returns (or raises CancelledError) when the channel stops on its own: the ingress stopped
        reading, or went away."""
        await asyncio.shield(self._sender)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sender.cancel()
        self._watcher.cancel()
        for task in self.requests.values():
            task.cancel()
        self._socket.disable_monitor()
        self._monitor.close()
        self._socket.close()

    async def _watch_peer(self) -> None:
        connected = False
        while True:
            try:
                frames = await asyncio.wait_for(self._monitor.recv_multipart(), None if connected else PEER_GRACE_S)
            except TimeoutError:
                logger.warning(
                    "ingress channel %s: its ingress has been gone for %.0f s; aborting its %d request(s)",
                    self.channel_id,
                    PEER_GRACE_S,
                    len(self.requests),
                )
                self.close()
                return
            connected = parse_monitor_message(frames)["event"] == zmq.EVENT_CONNECTED

    async def _send_forever(self) -> None:
        while True:
            batch = [await self._outbox.get()]
            while not self._outbox.empty():
                batch.append(self._outbox.get_nowait())
            try:
                await self._socket.send(_encode(batch), flags=zmq.NOBLOCK)
            except zmq.Again:
                logger.warning("ingress channel %s is not reading; dropping it", self.channel_id)
                self.close()
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
