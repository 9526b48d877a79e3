"""Process logging for every component: plain text or JSON lines, chosen by the environment.

``configure_logging(level)`` is called once by a component's CLI. With
``PDSERVE_LOG_FORMAT=json`` each record is one JSON object (``ts``, ``level``,
``logger``, ``msg``, and ``request_id`` / ``instance`` when the record carries them
through ``extra``), which log pipelines index without parsing; anything else keeps
the readable text format. The request id a Coordinator assigns is the engines'
request id too, so one grep of it finds the Coordinator's, P's and D's lines.

``log_request`` writes the access line of a finished HTTP request: its
``x-request-id`` response header, method, path, status and duration (the
Coordinator's front calls it once per request).
"""

from __future__ import annotations

import json
import logging
import os
import time

FORMAT_ENV = "PDSERVE_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
EXTRA_FIELDS = ("request_id", "instance", "role")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        for key in EXTRA_FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def is_json() -> bool:
    return os.environ.get(FORMAT_ENV, "text").strip().lower() == "json"


def configure_logging(level: str = "INFO") -> None:
    """Called once by each component's CLI, instead of ``logging.basicConfig``."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if is_json() else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def log_request(logger: logging.Logger, scope, status: int, request_id: str | None,
                start: float) -> None:
    """The access line of a finished request (``start``: its ``time.monotonic()`` at
    arrival): INFO when it carries a request id, else DEBUG (probes, metrics and the
    status page are not worth a line each)."""
    if request_id is None and not logger.isEnabledFor(logging.DEBUG):
        return
    level = logging.INFO if request_id is not None else logging.DEBUG
    logger.log(level, "request %s %s %s %d %.3fs", request_id or "-", scope["method"],
               scope["path"], status, time.monotonic() - start, extra={"request_id": request_id})
