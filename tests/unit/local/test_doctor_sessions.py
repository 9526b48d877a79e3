"""``pdserve doctor``'s row of the Coordinator's engine sessions: the open ones pass,
none open yet says nothing."""

from __future__ import annotations

from pdserve.local.doctor import PASS, check_sessions


def test_open_sessions_pass():
    rows = check_sessions({"10.0.0.1:5001": "frames", "10.0.0.2:5001": "frames"})
    assert [(r.name, r.status) for r in rows] == [("engine sessions", PASS)]
    assert rows[0].detail == "2 open, on the engines' session ports"


def test_no_session_open_yet_says_nothing():
    assert check_sessions({}) == []
