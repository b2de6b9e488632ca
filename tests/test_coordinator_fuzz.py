"""A real coordinator on loopback against random malformed, unauthenticated and absurd
requests (tests/coordinator_fuzzing.py): seeded and replayable, bounded in time.

    ZEROPLANE_FUZZ_SEED=1234 python -m pytest tests/test_coordinator_fuzz.py   # replay a seed

bench/coordinator_fuzz.py runs the same with ten thousand requests and prints figures.
"""

from __future__ import annotations

import logging
import os

import pytest

from coordinator.core.conversions import param_from_proto
from tests.coordinator_fuzzing import KINDS, fuzz
from tests.coordinator_util import HealthProbe, client, config, inventory, running, worker

pytestmark = pytest.mark.timeout(120)

SEED = int(os.environ.get("ZEROPLANE_FUZZ_SEED", "20261130"))
PER_KIND = 300


def test_no_request_poisons_the_coordinator(caplog) -> None:
    caplog.set_level(logging.INFO)
    with running(config(max_workers=8, lease_timeout_s=2.0)) as server:
        with HealthProbe(server.port) as probe:
            result = fuzz(server.port, seed=SEED, per_kind=PER_KIND)
        replay = f"(replay: ZEROPLANE_FUZZ_SEED={SEED})"
        assert sum(result.sent.values()) == PER_KIND * len(KINDS) + 3
        assert not result.unexpected, f"{result.unexpected[:10]} {replay}"
        assert not probe.failures, f"health failed: {probe.failures[:5]} {replay}"
        assert probe.worst < 2.0, f"health took {probe.worst:.2f}s {replay}"
        # every family reached the server and each was answered in kind
        assert {"OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"} <= set(result.codes), result.codes

        # a legitimate worker (of the job's model, whichever registration set it) still
        # registers and is given a generation
        job = [param_from_proto(p) for p in result.job_inventory or ()] or inventory()
        with client(server) as legit:
            legit.register(worker("legit"), job)
            legit.start()
            generation = legit.wait_for_generation(timeout=30)
            assert generation.rank_of("legit") is not None
    noisy = [
        (r.name, r.getMessage()[:200])
        for r in caplog.records
        if r.exc_info or "internal error" in r.getMessage() or r.name.startswith("grpc")
    ]
    assert not noisy, f"{noisy[:5]} {replay}"
