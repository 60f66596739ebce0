"""An ingress replica's own metrics on a port of its own, so Prometheus scrapes every replica directly.

The serving port reaches one replica per request (HAProxy or Serve's proxy picks it): scraping it sees
a different replica's counters each time, and their series interleave. Each replica therefore also
listens on ``metrics_port + local_rank`` (Ray Serve numbers the replicas on a node 0, 1, …), ports
a scrape config can list. aiohttp (already in Ray's stack) serves it on the replica's event loop, where
the router state the metrics read lives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

logger = logging.getLogger(__name__)
BIND_RETRY_S = 5.0


async def serve_replica_metrics(host: str, port: int, render: Callable[[], bytes]) -> None:
    """Serve ``render()`` on ``GET /metrics`` until cancelled. A port still held (the replica this one
    replaces is draining) is tried again every few seconds."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        while True:
            try:
                await web.TCPSite(runner, host, port).start()
                break
            except OSError as err:
                logger.warning("replica metrics port %d is busy (%s); trying again in %.0f s", port, err, BIND_RETRY_S)
                await asyncio.sleep(BIND_RETRY_S)
        logger.info("replica metrics on %s:%d/metrics", host, port)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
