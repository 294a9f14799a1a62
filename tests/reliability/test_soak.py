"""A bounded soak (about 40 s): 1.5x capacity with node churn; the full run is `macpool bench soak`."""

from __future__ import annotations

import pytest

from macpool.bench.soak import SoakOptions, run

pytestmark = pytest.mark.slow


def test_short_soak() -> None:
    options = SoakOptions(duration_s=40, churn_every_s=6, warmup_s=12)
    result = run(options, log=print)
    print(result)
    assert result.errors_non_503 == 0, result.error_kinds
    assert result.retry_after_missing == 0
    assert result.leftover and result.checks["counters_back_to_zero"], result.leftover
    assert result.checks["churn_happened"], result.churn
    assert result.rss_growth < 0.10, (result.rss_warm_mb, result.rss_end_mb)
    assert result.passed, result.checks
