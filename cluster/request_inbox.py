"""A leader's inbox: where the ingress replicas submit requests and abort them, over ZeroMQ.

One PULL socket per leader, bound once its engine runs; every ingress replica PUSHes to it
(``cluster.contract.encode_submission``, ``encode_abort``). A Ray actor call took about 3 ms from
the ingress's ``remote()`` to the leader's method here (pickling the request, Ray's submission
path, the actor's scheduling; measured at concurrency 1 on 2 cores), a ZeroMQ message well under
one. Submissions and aborts share the socket, so an abort never overtakes its request. The
ingress learns that a leader died from its channel's ``attach`` call, as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from flotilla.cluster.contract import InboxHeader, decode_header, decode_request

logger = logging.getLogger(__name__)

Submit = Callable[[InboxHeader, Any], None]
"""Called with a submission's header and its ``EngineCoreRequest``, or None where the request did not decode."""


class RequestInbox:
    def __init__(self, host: str, submit: Submit, abort: Callable[[str], None]) -> None:
        self._submit = submit
        self._abort = abort
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://{host}:{self._socket.bind_to_random_port(f'tcp://{host}')}"
        self._receiver = asyncio.create_task(self._receive_forever())

    def close(self) -> None:
        self._receiver.cancel()
        self._socket.close()

    async def _receive_forever(self) -> None:
        while True:
            header, *frames = await self._socket.recv_multipart(copy=False)
            try:
                message = decode_header(header.buffer)
            except Exception as err:  # a foreign sender: Flotilla's ingress always sends a header that decodes
                logger.error("undecodable message in the inbox at %s: %s", self.endpoint, err)
                continue
            try:
                self._handle(message, frames)
            except Exception:  # one bad message never stops the inbox
                logger.exception("inbox message %s %s failed", message.kind, message.key)

    def _handle(self, message: InboxHeader, frames: list[Any]) -> None:
        if message.kind == "abort":
            self._abort(message.key)
            return
        try:
            request = decode_request([frame.buffer for frame in frames])
        except Exception as err:
            logger.error("request %s in the inbox at %s does not decode: %s", message.key, self.endpoint, err)
            request = None
        self._submit(message, request)
