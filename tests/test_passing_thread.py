"""in_passing_thread (sudu/cluster/passing_thread.py): the call's result and errors come back, and the
OpenMP team its parallel work made ends with it, where a long-lived thread's stays."""
import os
import threading
import time

import pytest
import torch

from sudu.cluster.passing_thread import in_passing_thread


def _threads() -> set[str]:
    """This process's thread ids: compared as sets, so threads that other tests left behind may end meanwhile."""
    return set(os.listdir("/proc/self/task"))


def _parallel_work() -> float:
    return float((torch.randn(512, 512) @ torch.randn(512, 512)).sum() + (torch.randn(1 << 21) * 2).sum())


def _new_threads(before: set[str], timeout_s: float = 5.0) -> set[str]:
    """Threads that are alive now and were not in `before`, once none are left (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while _threads() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads() - before


def test_result_and_exception_come_back():
    assert in_passing_thread(lambda: threading.current_thread().name) == "sudu-passing"
    with pytest.raises(ZeroDivisionError):
        in_passing_thread(lambda: 1 / 0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_calls_openmp_team_ends_with_it():
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        before = _threads()
        in_passing_thread(_parallel_work)
        assert _new_threads(before) == set()
        # the contrast: the same work in a thread that stays leaves its team behind
        done, release = threading.Event(), threading.Event()

        def stay() -> None:
            _parallel_work()
            done.set()
            release.wait()

        keeper = threading.Thread(target=stay, daemon=True)
        keeper.start()
        done.wait(30)
        try:
            assert len(_threads() - before) >= 2  # the thread itself and at least one OpenMP worker
        finally:
            release.set()
            keeper.join()
    finally:
        torch.set_num_threads(before_threads)
