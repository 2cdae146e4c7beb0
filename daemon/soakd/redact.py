"""Secrets out of everything soakd prints or writes: URLs (userinfo in any scheme's case, token-like query
parameters), free text holding URLs, and config dumps (secret-looking environment values). Secrets belong
in credentials or the environment, never in the config file; this catches the ones put there anyway.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

REDACTED = "<redacted>"

# Query parameters that carry credentials: InfluxDB 1.x (`p`, `u` with it), OAuth-style access tokens,
# signed URLs (`sig`, `signature`, `X-Amz-*`), API keys under any common spelling.
_SECRET_PARAM = re.compile(
    r"^(p|u|password|passwd|pwd|token|.*_token|.*-token|apikey|api_key|api-key|key|secret|.*secret.*"
    r"|sig|signature|x-amz-.*|auth|authorization|credential.*|session)$",
    re.IGNORECASE,
)
_SECRET_NAME = re.compile(r"token|secret|passw|pwd|key|credential|auth", re.IGNORECASE)
# A URL inside text: a scheme, "://", then anything up to whitespace or a closing quote/bracket.
# A scheme starts only where a run of scheme characters starts (not inside one, as at every "." of
# "a.a.a..." with a word boundary: quadratic), and each run is possessive: linear in the text.
_URL_IN_TEXT = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*+://[^\s\"'<>`]++")


def redact_url(url: str) -> str:
    """The URL with its userinfo and secret query values replaced; an unparsable one as a placeholder
    (its text may hold the secret that made it unparsable)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        return "<invalid url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = "&".join(f"{k}={REDACTED}" if _SECRET_PARAM.match(k) else f"{k}={v}" for k, v in pairs)
    fragment = REDACTED if parts.fragment and "=" in parts.fragment else parts.fragment
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """Free text (a log line, an error, a check's detail) with every URL in it redacted."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def redacted(value: Any, key: str = "", parent: str = "") -> Any:
    """A config dump fit for meta.json and `compare`: URLs anywhere redacted, and secret-looking
    environment values (`engine.server.env`) replaced."""
    if isinstance(value, dict):
        return {k: redacted(v, str(k), key) for k, v in value.items()}
    if isinstance(value, list):
        return [redacted(v, key, parent) for v in value]
    if isinstance(value, str):
        if parent == "env" and _SECRET_NAME.search(key) and value:
            return REDACTED
        return redact_text(value)
    return value
