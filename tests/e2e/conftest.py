"""Fixtures of the end-to-end tests: ``cluster``, a fresh stand-in per test.

Teardown (also after a failed test) stops every Pod and checks that no process was
left and that the stand-in's own loops raised nothing. A test that fails gets the
cluster's state in its report, taken before teardown: every Pod's phase, restarts and
log tail, and the Warning Events. The stand-in's own tests run first: when they fail,
what the pdserve tests say is not worth reading.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.e2e.standin import Cluster, StandinUnavailable


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: item.path.name != "test_standin.py")  # stable: keeps the rest in order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    standin = getattr(item, "funcargs", {}).get("cluster")
    if report.when == "call" and report.failed and isinstance(standin, Cluster):
        with contextlib.suppress(Exception):  # a report without it beats no report
            report.sections.append(("the stand-in cluster when the test failed", standin.diagnostics()))


@pytest.fixture
def cluster(tmp_path):
    standin = Cluster(tmp_path / "cluster")
    try:
        standin.start()
    except StandinUnavailable as exc:
        pytest.fail(f"the cluster stand-in cannot start here: {exc} (`make test` installs what it needs)")
    try:
        yield standin
    finally:
        standin.stop()
    leaks = standin.leaks()
    assert not leaks, f"processes left after teardown: {leaks}"
    assert not standin.errors, "the stand-in failed:\n" + "\n".join(standin.errors)
