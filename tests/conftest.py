from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def fork_server():
    """zeroplane's own fork server (coordinator/launchers/spawner.py [Note: fork server]),
    shared by the tests that start worker scripts themselves: each ``fork`` is a worker
    as ``python script.py`` would start it, without importing torch again (1.5-2 s of
    CPU per worker on this machine's two cores)."""
    from coordinator.launchers.spawner import ForkServer
    from tests.test_mesh_elastic import _env

    server = ForkServer({**_env(), "OMP_NUM_THREADS": "1"}, subreaper=False)
    yield server
    server.close()


@pytest.fixture
def mesh_job(tmp_path: Path):
    """``start(*flags, stage=, mesh=, step_sleep=, script=, steps=, script_flags=)``: a
    ``zeroplane run`` of an elastic test script in the background
    (tests/test_mesh_elastic.py ``MeshRun``), closed after the test."""
    from tests.test_mesh_elastic import SCRIPT, MeshRun

    runs: list[MeshRun] = []

    def start(
        *flags: str,
        stage: int,
        mesh: tuple[str, ...] = ("--tp", "2"),
        step_sleep: float = 0.4,
        script: Path = SCRIPT,
        **more,
    ) -> MeshRun:
        runs.append(
            MeshRun(
                tmp_path,
                *flags,
                stage=stage,
                mesh=mesh,
                step_sleep=step_sleep,
                script=script,
                **more,
            )
        )
        return runs[-1]

    yield start
    for r in runs:
        r.close()
