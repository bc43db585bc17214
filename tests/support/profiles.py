"""How many examples a hypothesis test draws: few in the `default` profile (every run, CI), the
count the test names in the `thorough` profile (HYPOTHESIS_PROFILE=thorough, before a release or
after a change to the code the test covers). tests/conftest.py registers and loads the profiles.

    @settings(max_examples=examples(200), deadline=None)   # 200 when thorough, else 25
    @settings(max_examples=examples(500, default=100))      # a test that wants more by default
"""
from __future__ import annotations

from hypothesis import settings

DEFAULT_EXAMPLES = 25
THOROUGH_EXAMPLES = 500  # the most any test names; what a test that names none draws when thorough


def examples(thorough: int, default: int | None = None) -> int:
    """`thorough` under the thorough profile; else `default` (the profile's count when None), at
    most `thorough`."""
    if settings.get_current_profile_name() == "thorough":
        return thorough
    return min(thorough, settings.default.max_examples if default is None else default)
