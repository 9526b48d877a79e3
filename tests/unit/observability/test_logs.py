"""``pdserve.runtime.logs``: JSON or text lines chosen by PDSERVE_LOG_FORMAT. (The
Coordinator's access line and its request id: tests/unit/coordinator/test_front.py.)"""

from __future__ import annotations

import json
import logging

from pdserve.runtime.logs import JsonFormatter, configure_logging


def test_json_lines_carry_request_id(monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_LOG_FORMAT", "json")
    configure_logging("INFO")
    try:
        logging.getLogger("pdserve.test").info("request %s admitted", "cmpl-1",
                                               extra={"request_id": "cmpl-1"})
        line = capsys.readouterr().err.strip().splitlines()[-1]
    finally:
        logging.getLogger().handlers.clear()
    record = json.loads(line)
    assert record["msg"] == "request cmpl-1 admitted"
    assert record["request_id"] == "cmpl-1" and record["level"] == "INFO"
    assert record["logger"] == "pdserve.test"


def test_text_is_the_default(monkeypatch):
    monkeypatch.delenv("PDSERVE_LOG_FORMAT", raising=False)
    configure_logging("INFO")
    try:
        [handler] = logging.getLogger().handlers
        assert not isinstance(handler.formatter, JsonFormatter)
    finally:
        logging.getLogger().handlers.clear()


def test_exceptions_are_one_json_line():
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text and "ValueError: boom" in json.loads(text)["exc"]
