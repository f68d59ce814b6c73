"""The loaders' prefetch threads, stopped before the interpreter exits.

A prefetch thread still inside pyarrow at interpreter exit aborts the process ("terminate called without an
active exception"), and one still inside `ray.get` when Ray's exit hook disconnects it aborts it too
(raydl.data.ray_source joins them before that hook runs).
"""

from __future__ import annotations

import atexit
import threading

PREFETCHERS: list[tuple[threading.Event, threading.Thread]] = []   # (its stop request, the thread)


@atexit.register
def stop_prefetchers() -> None:
    for stop, thread in PREFETCHERS:
        stop.set()
    for _, thread in PREFETCHERS:
        thread.join(timeout=10)
