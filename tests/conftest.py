"""Test-wide settings.

Hypothesis: no per-example deadline (the 2-core CI machine is shared and timing is not what
these tests check); under CI the examples are derandomised so that a run is reproducible.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "default")
