"""``pdserve doctor``'s row of what the Coordinator's engine sessions ride: frames on
the session ports pass, a session on gRPC warns with the fix, none open says nothing."""

from __future__ import annotations

from pdserve.local.doctor import PASS, WARN, check_sessions


def test_sessions_on_frames_pass_and_one_on_grpc_warns():
    rows = check_sessions({"10.0.0.1:5001": "frames", "10.0.0.2:5001": "grpc"})
    assert [(r.name, r.status) for r in rows] == [
        ("engine sessions", PASS), ("session 10.0.0.2:5001", WARN)]
    assert rows[0].detail == "1 of 2 on the engines' session ports"
    assert "session port" in rows[1].fix


def test_no_session_open_yet_says_nothing():
    assert check_sessions({}) == []
