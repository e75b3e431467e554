"""Every failed request leaves a line in the server's log: its id, the API it called, the status
and the error, and the first time each kind of error appears, its traceback. A 500 that the log
does not show cannot be fixed by the people who run the server.

    failures = FailureLog()
    failures.record("chatcmpl-1 on /v1/chat/completions", ApiError(500, "...", trace=text))
"""

import logging
import re
from typing import Optional

from server.request import ApiError

log = logging.getLogger("server")


def configure_logging():
    """The server's log on stderr: one line per record, its level first."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")


def kind_of(trace: str) -> str:
    """What makes two errors the same kind: the exception's type and the innermost frame it was
    raised in (file and line), read from its printed traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    last = trace.strip().splitlines()[-1] if trace.strip() else ""
    where = ":".join(frames[-1]) if frames else ""
    return f"{last.split(':')[0]} at {where}"


class FailureLog:
    """Logs each failed request once, with a traceback once per kind of error (``kind_of``)."""

    def __init__(self):
        self.kinds = set()  # kinds whose traceback is in the log already
        self.count = 0  # requests that failed

    def record(self, request: Optional[str], error: ApiError):
        """``request``: its id and the API it called; None before it was given an id. A 4xx is
        the client's to fix: a warning without a traceback."""
        self.count += 1
        line = f"request {request or '(no id yet)'} failed: {error.status} {error.message}"
        if error.status < 500:
            log.warning(line)
            return
        trace = error.trace
        if trace:
            kind = kind_of(trace)
            if kind in self.kinds:
                trace = None
            self.kinds.add(kind)
        log.error(line + ("\n" + trace.rstrip() if trace else ""))
