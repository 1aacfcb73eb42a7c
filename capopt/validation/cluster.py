"""Validation candidates as Ray tasks: one per candidate, on whichever node has room.

Each task runs the same worker process a local validation runs (`runner._run_one`: one
candidate, one process, its own timeout), so a candidate measures the same on a cluster as
here. A task asks for one CPU (the compile-only tiers) or one GPU (the ``device`` tier).
Results come back as they finish, and the caller streams each into its JSONL file, so a
cluster that fails part-way keeps what finished. Ray is the optional ``ray`` extra; every
node needs capopt installed (the tasks import it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Callable

from .._errors import CapoptError


def _ray():
    try:
        import ray
    except ImportError:
        raise CapoptError("running candidates on a Ray cluster needs Ray: pip install "
                          "'capopt[ray]'", field="--ray") from None
    return ray


def connect(address: str) -> None:
    """Join the cluster at ``address`` (``auto``: the one this machine belongs to; ``local``:
    start one on this machine), once per process."""
    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError, TimeoutError) as e:
        ray.shutdown()              # a half-made connection would refuse the next ray.init
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CapoptError(f"cannot reach a Ray cluster at {address!r}: {first[:200]}",
                          field="--ray", allowed="auto, local, or ray://HOST:PORT") from None


def run_tasks(jobs: Iterable[tuple[int, dict]], run: Callable[[dict, float], dict],
              timeout_s: float, *, gpus: float = 0.0) -> Iterator[tuple[int, dict[str, Any]]]:
    """``run(job, timeout_s)`` for each ``(index, job)`` as a Ray task; yields ``(index,
    result)`` in the order they finish. A task that dies (its node lost) yields an error
    result instead of raising."""
    ray = _ray()
    task = ray.remote(run).options(num_cpus=1, num_gpus=gpus, max_retries=0)
    pending = {task.remote(job, timeout_s): i for i, job in jobs}
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1)
        for ref in done:
            i = pending.pop(ref)
            try:
                yield i, ray.get(ref)
            except Exception as e:          # RayTaskError, WorkerCrashedError, NodeDiedError
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                yield i, {"status": "error", "error": f"ray task failed: {first[:300]}"}


__all__ = ["connect", "run_tasks"]
