"""Test-wide settings.

Hypothesis: no per-example deadline (the 2-core CI machine is shared and timing is not what
these tests check); under CI the examples are derandomised so that a run is reproducible.
"""

import os

# No test reads or writes the user's on-disk store of traces (``vramplan cache``): a stored trace
# would answer a test that patches the tracer, and test runs would fill ~/.cache. Subprocesses
# inherit it; tests of the store set their own folder and lift it.
os.environ["VRAMPLAN_NO_CACHE"] = "1"

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_estimate_caches():
    """Each test starts without the process's cached traces and replays (``vramplan.engine.cache``):
    a test that patches the tracer or counts traces sees its own calls, not an earlier test's."""
    from vramplan.engine import cache

    cache.clear()
    yield
