"""Thread helpers shared by the model stages (retrieval's embeddings, the embedded LLM): torch and BLAS."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


def auto_threads(configured: int = 0) -> int:
    """How many torch intra-op threads to use now: ``configured`` if > 0, else all usable cores,
    or 1 while the machine is already busy (1-minute load average >= cores - 0.5).

    Why: with OpenMP, threads wait for each other at every operation; when other processes hold
    the cores, a 2-thread pass stalls. Measured on the shared 2-core dev box at load ~2-4: a
    query embedding took 720 ms with 2 threads and 41 ms with 1; label scoring ~6 s vs ~1.4 s.
    On an idle box 2 threads score in ~0.7 s against ~1.2 s for 1."""
    if configured > 0:
        return configured
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] >= cores - 0.5
    except OSError:
        busy = False
    return 1 if busy else cores


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run with ``n`` intra-op threads, then restore (the setting is process-wide)."""
    import torch

    prev = torch.get_num_threads()
    if n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


@contextmanager
def blas_threads(n: int) -> Iterator[None]:
    """Run numpy's BLAS with ``n`` threads, then restore (see auto_threads for why fewer can be faster)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # optional: without it BLAS keeps its own default
        yield
        return
    with threadpool_limits(limits=n, user_api="blas"):
        yield
