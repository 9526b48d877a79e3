"""Process logging for every component: plain text or JSON lines, chosen by the environment.

``configure_logging(level)`` is called once by a component's CLI. With
``PDSERVE_LOG_FORMAT=json`` each record is one JSON object (``ts``, ``level``,
``logger``, ``msg``, and ``request_id`` / ``instance`` when the record carries them
through ``extra``), which log pipelines index without parsing; anything else keeps
the readable text format. The request id a Coordinator assigns is the engines'
request id too, so one grep of it finds the Coordinator's, P's and D's lines.

``RequestLogMiddleware`` (ASGI) logs one line per finished HTTP request with its
``x-request-id`` response header, method, path, status and duration
(``log_request``, which a route serving itself calls directly).
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


class RequestLogMiddleware:
    """ASGI middleware: one INFO line per HTTP request, after its last body byte."""

    def __init__(self, app, logger_name: str = "pdserve.access") -> None:
        self.app = app
        self.log = logging.getLogger(logger_name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.monotonic()
        seen = {"status": 0, "request_id": None}

        async def send_logged(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == b"x-request-id":
                        seen["request_id"] = value.decode("latin-1")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                log_request(self.log, scope, seen["status"], seen["request_id"], start)

        await self.app(scope, receive, send_logged)


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
