"""Where the coordinator keeps the operator's routing choice: Ray's GCS key-value store.

The coordinator's memory dies with it; the GCS outlives a coordinator restart (and, with GCS fault
tolerance, a head restart). Ray Serve keeps its own checkpoints the same way (``internal_kv``); no
public Ray API stores a small value cluster-wide. A new ``flotilla serve`` starts from its config and
clears what an earlier one chose.
"""

from __future__ import annotations

import asyncio
import json
import logging

from flotilla.cluster.contract import RoutingChoice

logger = logging.getLogger(__name__)
KV_NAMESPACE = "flotilla"


def _key(namespace: str) -> bytes:
    return f"routing/{namespace}".encode()


async def load(namespace: str) -> RoutingChoice | None:
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():  # the coordinator under unit tests
        return None
    raw = await asyncio.to_thread(internal_kv._internal_kv_get, _key(namespace), namespace=KV_NAMESPACE)
    if raw is None:
        return None
    try:
        stored = json.loads(raw)
        return RoutingChoice(str(stored["policy"]), dict(stored["params"]))
    except (ValueError, KeyError, TypeError) as err:
        logger.error("ignoring an unreadable stored routing choice (%s): %r", err, raw[:200])
        return None


async def save(namespace: str, choice: RoutingChoice | None) -> None:
    import ray
    from ray.experimental import internal_kv

    if not ray.is_initialized():
        return
    if choice is None:
        await asyncio.to_thread(internal_kv._internal_kv_del, _key(namespace), namespace=KV_NAMESPACE)
        return
    value = json.dumps({"policy": choice.policy, "params": choice.params}).encode()
    await asyncio.to_thread(internal_kv._internal_kv_put, _key(namespace), value, namespace=KV_NAMESPACE)
