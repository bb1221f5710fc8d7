"""Structured logs: one line per record, logfmt by default, JSON on request.

Every record may carry `step`, `generation` and `replica` (pass them in
`extra=`); they are printed when set, so a grep for `replica=2` follows one
replica through controller, agent and worker logs alike.
"""

from __future__ import annotations

import json
import logging
import os
import sys

CONTEXT_FIELDS = ("step", "generation", "replica")


class StructuredFormatter(logging.Formatter):
    def __init__(self, component: str, as_json: bool = False) -> None:
        super().__init__()
        self._component = component
        self._as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, object] = {
            "ts": f"{record.created:.3f}",
            "level": record.levelname.lower(),
            "component": self._component,
            "msg": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None and value != -1:
                fields[name] = value
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self._as_json:
            return json.dumps(fields)
        return " ".join(f"{k}={_quote(v)}" for k, v in fields.items())


def _quote(value: object) -> str:
    text = str(value)
    return json.dumps(text) if (" " in text or "=" in text or not text) else text


def configure(component: str, level: str | None = None) -> None:
    """Route the `recover` loggers to stderr; RECOVER_LOG_LEVEL / RECOVER_LOG_FORMAT=json tune it."""
    level = level or os.environ.get("RECOVER_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(component, os.environ.get("RECOVER_LOG_FORMAT") == "json"))
    root = logging.getLogger("recover")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
