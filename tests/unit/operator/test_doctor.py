"""The operator's doctor: background runs by cluster, and the Doctor condition they
write (the checks themselves are faked: injected as ``checks``)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

import pytest

from pdserve.api.proto import controller_pb2 as cpb
from pdserve.operator import doctor as doctor_module
from pdserve.operator.doctor import DoctorRuns, apply_doctor_condition, build_doctor_condition
from pdserve.runtime.doctor_checks import FAIL, PASS, WARN, Check

NOW = datetime(2026, 1, 1, tzinfo=UTC)
KEY = ("ns", "tiny")
INSTANCES = [cpb.InstanceView(instance_id="tiny-prefill-0", role="prefill", engine_address="p:1"),
             cpb.InstanceView(instance_id="tiny-decode-0", role="decode", engine_address="d:1")]


def doctor_condition(status: dict) -> dict:
    return next(c for c in status["conditions"] if c["type"] == "Doctor")


class FakeChecks:
    """Returns ``findings`` (or raises, or hangs), recording each call's arguments."""

    def __init__(self, findings: list[Check] | None = None, hang: bool = False) -> None:
        self.findings, self.hang, self.calls = findings or [], hang, []

    async def __call__(self, instances, security) -> list[Check]:
        self.calls.append(([i.instance_id for i in instances], security.token))
        if self.hang:
            await asyncio.Event().wait()
        if isinstance(self.findings, Exception):
            raise self.findings
        return self.findings


def test_condition_unknown_before_the_first_run():
    status = apply_doctor_condition({"conditions": []}, None, 2, NOW)
    cond = doctor_condition(status)
    assert (cond["status"], cond["reason"], cond["observedGeneration"]) == ("Unknown", "NotRunYet", 2)


def test_condition_true_when_all_pass_and_lists_warnings():
    passed = [Check("engine p", PASS, "serving"), Check("kv p -> d", PASS, "ok")]
    assert build_doctor_condition(passed) == ("True", "ChecksPassed", "2 checks passed")
    warned = [*passed, Check("engine p clock", WARN, "skew +2.000 s to this host")]
    status, reason, message = build_doctor_condition(warned)
    assert (status, reason) == ("True", "ChecksPassed")
    assert "warnings: engine p clock: skew +2.000 s to this host" in message


def test_condition_false_lists_each_failing_check():
    findings = [Check("engine p", PASS, "serving"),
                Check("kv p -> d", FAIL, "connection refused"),
                Check("kv compatibility", FAIL, "hashes differ: p=1, d=2"),
                Check("engine d clock", WARN, "no time")]
    status = apply_doctor_condition({"conditions": []}, findings, 3, NOW)
    cond = doctor_condition(status)
    assert (cond["status"], cond["reason"]) == ("False", "ChecksFailed")
    assert cond["message"].startswith("failed: kv p -> d: connection refused; "
                                      "kv compatibility: hashes differ: p=1, d=2")
    assert "warnings: engine d clock: no time" in cond["message"]
    assert "engine p:" not in cond["message"]
    # the transition time moves only with the status
    again = apply_doctor_condition(status, findings, 3, NOW.replace(hour=5))
    assert doctor_condition(again)["lastTransitionTime"] == cond["lastTransitionTime"]


@pytest.mark.asyncio
async def test_runs_when_ready_then_once_per_interval():
    now = [0.0]
    checks = FakeChecks([Check("kv p -> d", FAIL, "refused")])
    runs = DoctorRuns(checks=checks, interval_s=60.0, clock=lambda: now[0])
    assert not runs.start_if_due(KEY, False, INSTANCES, "tok")  # not Ready: nothing runs
    assert runs.latest(KEY) is None
    assert runs.start_if_due(KEY, True, INSTANCES, "tok")       # became Ready: runs at once
    await asyncio.sleep(0.02)
    assert runs.latest(KEY) == checks.findings
    assert checks.calls == [(["tiny-prefill-0", "tiny-decode-0"], "tok")]
    now[0] = 30.0
    assert not runs.start_if_due(KEY, True, INSTANCES, "tok")   # within the interval
    now[0] = 61.0
    assert runs.start_if_due(KEY, True, INSTANCES, "tok")       # due again
    await asyncio.sleep(0.02)
    now[0] = 62.0
    runs.start_if_due(KEY, False, INSTANCES, "tok")
    assert runs.start_if_due(KEY, True, INSTANCES, "tok")       # Ready again: runs at once
    await asyncio.sleep(0.02)
    assert len(checks.calls) == 3
    await runs.close()


@pytest.mark.asyncio
async def test_a_hanging_run_times_out_and_one_runs_at_a_time():
    checks = FakeChecks(hang=True)
    runs = DoctorRuns(checks=checks, deadline_s=0.05)
    assert runs.start_if_due(KEY, True, INSTANCES, "tok")
    runs.start_if_due(KEY, False, INSTANCES, "tok")
    assert not runs.start_if_due(KEY, True, INSTANCES, "tok")  # the first is still running
    await asyncio.sleep(0.2)
    [finding] = runs.latest(KEY)
    assert (finding.name, finding.status) == ("doctor", FAIL) and "did not finish" in finding.detail
    assert len(checks.calls) == 1
    await runs.close()


@pytest.mark.asyncio
async def test_a_raising_check_is_a_finding_and_forget_cancels():
    runs = DoctorRuns(checks=FakeChecks(RuntimeError("boom")))
    runs.start_if_due(KEY, True, INSTANCES, "tok")
    await asyncio.sleep(0.02)
    [finding] = runs.latest(KEY)
    assert finding.status == FAIL and "boom" in finding.detail
    hanging = DoctorRuns(checks=FakeChecks(hang=True))
    hanging.start_if_due(KEY, True, INSTANCES, "tok")
    await asyncio.sleep(0.02)
    await hanging.forget(KEY)
    assert hanging.latest(KEY) is None and not hanging._tasks
    await runs.close()


@pytest.mark.asyncio
async def test_forget_does_not_wait_forever_for_a_run_that_ignores_its_cancellation(monkeypatch):
    monkeypatch.setattr(doctor_module, "FORGET_WAIT_S", 0.2)
    release = asyncio.Event()

    async def stubborn(instances, security):
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                continue  # swallows every cancellation
        return []

    runs = DoctorRuns(checks=stubborn)
    runs.start_if_due(KEY, True, INSTANCES, "tok")
    await asyncio.sleep(0.02)
    started = time.monotonic()
    await runs.forget(KEY)
    assert 0.2 <= time.monotonic() - started < 2.0 and runs.latest(KEY) is None
    release.set()
    await asyncio.sleep(0.1)
