"""Suite-wide rules. On CI (CI=true) a skipped test fails: every test's needs (g++, mlx-lm, the golden files)
are installed by .ci/run, so a skip there means a missing install step, not a test that does not apply."""

from __future__ import annotations

import os

import pytest

ON_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if ON_CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped on CI, where every test must run: {reason}"


@pytest.fixture(autouse=True)
def mlx_memory_limit():
    """MLX's memory limit as it was before the test: an expert pager a test leaves open keeps its budget's limit,
    under which MLX's evaluation of later tests' work would wait for each queued task."""
    import mlx.core as mx

    limit = mx.get_memory_limit()
    yield
    mx.set_memory_limit(limit)
