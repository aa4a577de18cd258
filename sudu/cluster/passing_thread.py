"""in_passing_thread: run a call in a thread that ends with it, for work whose per-thread state must not
outlive it (OpenMP's thread teams)."""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() run in a thread that ends with it, its result or its exception returned or raised here.

    OpenMP (torch's intra-op threads, sudu's kernels) keeps a team of worker threads for every thread
    that has run parallel work, for as long as that thread lives. Loading a model runs parallel work; on
    Serve's long-lived thread that team would stay beside the engine thread's own, more OpenMP workers
    than cores, and libgomp then has every worker sleep at each barrier instead of spinning: each step's
    many parallel regions pay a wake-up, and decoding slows by a large fraction
    (docs/cluster.md, "The replica's OpenMP threads")."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller's thread
            result.append((False, exc))

    thread = threading.Thread(target=run, name="sudu-passing")
    thread.start()
    thread.join()
    ok, value = result[0]
    if not ok:
        raise value
    return value
