import os

from hypothesis import HealthCheck, settings

# CI runs thousands of mutation cases; local runs stay quick. HYPOTHESIS_PROFILE picks.
settings.register_profile(
    "ci",
    max_examples=3000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=300, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
