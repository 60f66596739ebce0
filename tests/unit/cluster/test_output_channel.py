"""The leader's end of an ingress channel stops when its ingress goes away, and aborts that ingress's requests."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from flotilla.cluster import output_channel
from flotilla.cluster.output_channel import OutputChannel


def test_a_vanished_ingress_stops_the_channel_and_a_live_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(output_channel, "PEER_GRACE_S", 0.3)

    async def scenario() -> None:
        context = zmq.asyncio.Context.instance()
        ingress = context.socket(zmq.PULL)
        port = ingress.bind_to_random_port("tcp://127.0.0.1")
        channel = OutputChannel("c1", f"tcp://127.0.0.1:{port}")
        request = asyncio.create_task(asyncio.sleep(3600))  # a request generating for this ingress
        channel.requests["k1"] = request
        stopped = asyncio.create_task(channel.closed())
        await asyncio.sleep(1.0)  # a connected ingress: several grace periods pass without a stop
        assert not stopped.done()

        assert not channel.stopped and not request.done()

        ingress.close(linger=0)  # the ingress process dies: its end of the connection goes away
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stopped, 10)
        await asyncio.sleep(0)
        # Aborted by the channel itself: no attach call need be waiting on it (one may never have arrived).
        assert request.cancelled() and channel.stopped
        channel.close()  # what the leader's attach does next, if there is one: nothing more happens

    asyncio.run(scenario())
