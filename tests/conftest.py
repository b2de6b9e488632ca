from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import WorkerPool


class Pools:
    """One live WorkerPool per world size, created on first use."""

    def __init__(self) -> None:
        self._pools: dict[int, WorkerPool] = {}

    def __call__(self, world_size: int) -> WorkerPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = WorkerPool(world_size)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            if not pool.broken:
                pool.close()


@pytest.fixture(scope="session")
def pools() -> Iterator[Pools]:
    p = Pools()
    yield p
    p.close()
