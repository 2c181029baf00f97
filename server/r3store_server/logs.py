"""Logs: one JSON object a line (when stderr is not a terminal, or when asked), else
readable lines; both carry the request id where there is one, and the record's fields."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": request_id.get(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class TextFormatter(logging.Formatter):
    """`2026-11-29T19:20:01.123Z INFO  request GET /healthz 200 0.4 ms client=127.0.0.1`."""

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "fields", {}))
        if record.getMessage() == "request" and {"method", "path", "status"} <= fields.keys():
            head = f"{fields.pop('method')} {fields.pop('path')} {fields.pop('status')}"
            if "ms" in fields:
                head += f" {fields.pop('ms')} ms"
            message = f"request {head}"
        else:
            message = record.getMessage()
        rid = request_id.get()
        extra = " ".join(f"{k}={v}" for k, v in fields.items())
        line = (
            f"{_timestamp(record)} {record.levelname:<7} {message}"
            + (f" {extra}" if extra else "")
            + (f" [{rid}]" if rid != "-" else "")
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(level: str, as_json: bool | None = None) -> None:
    """Log at `level` to stderr: JSON lines when `as_json`, or when it is None and stderr
    is not a terminal."""
    if as_json is None:
        as_json = not sys.stderr.isatty()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").disabled = True  # our middleware logs requests
