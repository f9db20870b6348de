"""Secrets out of what is shown: the user and password of a URL, in every message, log line and MLflow param.

A URL may carry credentials (`https://user:password@host/...`, a mirror or a tracking server): the process that
connects uses them, and everything it shows passes through these functions first.
"""

from __future__ import annotations

import re
import urllib.parse


def _userinfo(url: str) -> str | None:
    """The `user:password` (or lone `user`) before the host of `url`; None without one, or for a path."""
    _scheme, separator, rest = url.partition("://")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    userinfo, at, _host = authority.rpartition("@")
    return userinfo if separator and at else None


def _redacted_userinfo(userinfo: str) -> str:
    user, colon, _password = userinfo.partition(":")
    # A lone user name is usually a token, so it goes too.
    return f"{user}:***" if colon else "***"


def redact(url: str) -> str:
    """`url` for messages and logs: `http://user:secret@host/x` -> `http://user:***@host/x`.

    A lone user name (`https://token@host/x`) becomes `***`; a URL without userinfo, or a
    local path, is returned unchanged.
    """
    userinfo = _userinfo(url)
    return url if userinfo is None else url.replace(f"{userinfo}@", f"{_redacted_userinfo(userinfo)}@", 1)


_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")


def redact_urls(text: str) -> str:
    """`text` (a message that may quote URLs) with the user and password of every URL in it replaced by `***`."""
    return _USERINFO.sub(r"\1***@", text)


def redact_text(text: str, url: str) -> str:
    """`text` (an exception's message, which may quote the URL) with `url`'s userinfo masked, decoded or not."""
    userinfo = _userinfo(url)
    if userinfo is None:
        return text
    for form in {userinfo, urllib.parse.unquote(userinfo)}:
        text = text.replace(f"{form}@", f"{_redacted_userinfo(userinfo)}@")
    return text
