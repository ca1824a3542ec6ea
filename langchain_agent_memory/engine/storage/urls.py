"""Store URLs as messages and logs show them: the secrets in them (a database password, an
S3 secret key or session token) masked, whichever part of the URL holds them."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlsplit, urlunsplit

#: Query parameters that hold secrets (libpq's and object stores' spellings).
SECRET_PARAMS = frozenset(
    {"password", "secret_access_key", "aws_secret_access_key", "session_token", "aws_session_token", "token"}
)


def redacted(url: str) -> str:
    """``url`` with its password and secret parameters replaced by ``***``."""
    parts = urlsplit(url)
    netloc = parts.netloc
    userinfo, at, host = netloc.rpartition("@")
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:***@{host}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = "&".join(f"{k}={'***' if k.lower() in SECRET_PARAMS else v}" for k, v in pairs)
    if "://" not in url:
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    # urlunsplit drops the "//" of an empty host (a socket URL: postgresql:///db?host=...)
    return (
        f"{parts.scheme}://{netloc}{parts.path}"
        + (f"?{query}" if query else "")
        + (f"#{parts.fragment}" if parts.fragment else "")
    )
