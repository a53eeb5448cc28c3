"""The one redaction helper: whatever kvserve prints, logs or returns as error
text goes through here first.

Two things are scrubbed:

- credentials inside URLs (``scheme://user:PASSWORD@host`` keeps the user and
  the host, the password becomes ``***``), wherever they appear in a text;
- every secret value this process has read (``register_secret``: Redis
  passwords, the deployment secret, API keys), in case one reaches a message
  some other way (an exception that quotes a config line, a library's repr).

``install_log_redaction`` puts a filter on the root logger's handlers so every
log record, its arguments and its traceback are scrubbed too; the CLI installs
it before any command runs.
"""

from __future__ import annotations

import logging
import re
import threading
from urllib.parse import urlsplit, urlunsplit

MASK = "***"
# scheme://[user]:password@  — the password is anything up to the last '@' of
# the authority (passwords may hold '@' when percent-encoding was skipped).
_URL_CREDENTIALS = re.compile(
    r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://(?P<user>[^\s:/@]*):)(?P<pw>[^\s/]*)@")
_MIN_SECRET_CHARS = 8          # shorter strings would mask ordinary words
_lock = threading.Lock()
_secrets: set[str] = set()


def register_secret(value: str | bytes) -> None:
    """Remember a secret value so that ``redact`` masks it wherever it appears
    (also its hex form when bytes are given)."""
    forms = [value.hex(), value.decode("utf-8", "ignore")] if isinstance(value, bytes) else [value]
    with _lock:
        _secrets.update(f for f in forms if len(f) >= _MIN_SECRET_CHARS)


def redact_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``; user, host,
    port, path and query stay readable."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return redact(url)
    if parts.password is None:
        return redact(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host += f":{parts.port}"
    netloc = f"{parts.username or ''}:{MASK}@{host}"
    return redact(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))


def redact(text: object) -> str:
    """``str(text)`` with URL passwords and every registered secret masked."""
    s = str(text)
    if "://" in s:
        s = _URL_CREDENTIALS.sub(lambda m: m.group("head") + MASK + "@"
                                 if m.group("pw") != MASK else m.group(0), s)
    with _lock:
        known = sorted(_secrets, key=len, reverse=True)
    for secret in known:
        if secret in s:
            s = s.replace(secret, MASK)
    return s


def has_credentials(url: str) -> bool:
    """Whether ``url`` carries a password (``scheme://[user]:password@``)."""
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return bool(_URL_CREDENTIALS.search(url))


class RedactingFilter(logging.Filter):
    """Renders each record's message (and traceback) once, scrubbed, so no
    handler formats the raw arguments afterwards."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: keep what there is
            message = f"{record.msg} {record.args}"
        record.msg = redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def install_log_redaction(logger: logging.Logger | None = None) -> None:
    """Scrub every record that reaches ``logger``'s handlers (root by default);
    handlers added later are covered by calling this again."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


__all__ = ["MASK", "RedactingFilter", "has_credentials", "install_log_redaction", "redact",
           "redact_url", "register_secret"]
