"""Block until the Ray cluster has the accelerator slots Flotilla's groups need, then exit 0.

    python wait_for_slots.py SLOTS TIMEOUT_S

Workers join a Ray cluster after its head starts; `flotilla serve` checks the slots once at
startup, so the head (Kubernetes pod or `ray up` node) runs this first.
"""

import sys
import time

import ray

need, timeout_s = float(sys.argv[1]), float(sys.argv[2])
ray.init(address="auto", logging_level="ERROR")
deadline = time.monotonic() + timeout_s
while (have := ray.cluster_resources().get("GPU", 0)) < need:
    if time.monotonic() > deadline:
        sys.exit(f"only {have:.0f} of {need:.0f} accelerator slots joined within {timeout_s:.0f} s")
    print(f"waiting for workers: {have:.0f}/{need:.0f} accelerator slots", flush=True)
    time.sleep(5)
print(f"{have:.0f} accelerator slots present", flush=True)
