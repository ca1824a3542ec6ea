"""Blocks as immutable objects in S3-compatible storage (through ``obstore``).

A block's object holds its safetensors file byte for byte, under
``{prefix}/{fingerprint}/{hash[:2]}/{hash}.safetensors``. Objects are content-addressed,
so a write is a conditional create (``If-None-Match: *``): the first writer wins and a
second write of the same block is a no-op. Every call has a deadline: an unreachable or
slow store raises ``RemoteUnavailableError`` quickly (the caller falls back to its local
tier) instead of retrying for minutes, as S3 clients do by default.

``s3://bucket/prefix?endpoint=http://127.0.0.1:8333&region=us-east-1``: the query sets
the client's options (any key of obstore's ``S3Config``); credentials and the rest come
from the usual ``AWS_*`` environment variables. An ``http://`` endpoint is allowed (a
server on loopback); without credentials requests go unsigned.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from ..errors import BlocksUnavailableError, RemoteConfigError, RemoteUnavailableError  # noqa: F401 - defined there, re-exported
from .blocks import BlockHash
from .urls import redacted

#: What the S3 client says when no server answered (connection refused, no route, a name
#: that does not resolve, a timeout), as opposed to a server's own error.
UNREACHABLE = (
    "error sending request", "Connection refused", "connection refused", "dns error", "timed out",
    "operation timed out", "No route to host", "tcp connect error", "TimedOut", "kind: Timeout",
)  # fmt: skip


#: S3 error codes of wrong credentials -> what to fix.
KEY_ERRORS = {
    "InvalidAccessKeyId": "the server knows no such access key: check AWS_ACCESS_KEY_ID (or access_key_id=)",
    "SignatureDoesNotMatch": (
        "the secret key does not match the access key: check AWS_SECRET_ACCESS_KEY (or secret_access_key=)"
    ),
    "ExpiredToken": "the session token has expired: renew AWS_SESSION_TOKEN",
    "InvalidToken": "the session token is not valid: check AWS_SESSION_TOKEN",
}


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime


class ObjectBlocks:
    """The block objects of every model under one bucket prefix."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        import obstore  # imported here: only a shared store needs it
        from obstore.store import S3Store

        self._obs = obstore
        parts = urlsplit(url)
        if parts.scheme != "s3" or not parts.netloc:
            raise RemoteConfigError(
                f"blocks={redacted(url)!r}: expected s3://bucket[/prefix][?endpoint=http://host:port], "
                "e.g. s3://agent-memory/kv?endpoint=http://127.0.0.1:8333"
            )
        self.url = redacted(url)  # for messages: the keys' secrets masked
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        config: dict[str, Any] = dict(parse_qsl(parts.query))
        endpoint = (
            config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT")
        )
        config.setdefault(
            "region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        )
        if not (os.environ.get("AWS_ACCESS_KEY_ID") or "access_key_id" in config):
            config.setdefault("skip_signature", True)  # a server without credentials
        timeout = f"{max(0.05, timeout_s):.3f}s"
        client = {
            "timeout": timeout,
            "connect_timeout": timeout,
            "allow_http": bool(endpoint and endpoint.startswith("http:")),
        }
        # One quick retry: a deadline, not the default minutes of backoff.
        retry = {
            "max_retries": 1,
            "retry_timeout": timedelta(seconds=timeout_s),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(milliseconds=200),
                "base": 2.0,
            },
        }
        try:
            self._store = S3Store(self.bucket, config=config, client_options=client, retry_config=retry)
        except Exception as exc:  # obstore's configuration errors
            raise RemoteConfigError(f"blocks={self.url!r}: {exc}") from exc

    def key(self, fingerprint: str, h: BlockHash) -> str:
        name = f"{fingerprint}/{h[:2]}/{h}.safetensors"
        return f"{self.prefix}/{name}" if self.prefix else name

    def hash_of(self, key: str) -> BlockHash | None:
        name = key.rsplit("/", 1)[-1]
        return BlockHash(name.removesuffix(".safetensors")) if name.endswith(".safetensors") else None

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` unless it exists; True if this call created it."""
        try:
            self._obs.put(self._store, key, data, mode="create")
        except self._obs.exceptions.AlreadyExistsError:
            return False
        except self._obs.exceptions.PreconditionError:
            return False
        except Exception as exc:
            raise self._unavailable("write", key, exc) from exc
        return True

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None if there is none."""
        try:
            return bytes(self._obs.get(self._store, key).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._unavailable("read", key, exc) from exc

    def exists(self, key: str) -> bool:
        """Whether the object is there (its metadata only)."""
        try:
            self._obs.head(self._store, key)
        except FileNotFoundError:
            return False
        except Exception as exc:
            raise self._unavailable("look up", key, exc) from exc
        return True

    def delete(self, key: str) -> None:
        try:
            self._obs.delete(self._store, key)
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._unavailable("delete", key, exc) from exc

    def list(self, fingerprint: str) -> Iterator[ObjectInfo]:
        """Every object stored for one model."""
        prefix = self.key(fingerprint, BlockHash("00")).rsplit("/", 2)[0]
        try:
            for batch in self._obs.list(self._store, prefix=prefix):
                for meta in batch:
                    yield ObjectInfo(meta["path"], int(meta["size"]), meta["last_modified"])
        except Exception as exc:
            raise self._unavailable("list", prefix, exc) from exc

    @property
    def identity(self) -> str:
        """Where the blocks live, whatever endpoint reaches them: ``bucket/prefix``."""
        return f"{self.bucket}/{self.prefix}"

    def check(self) -> None:
        """Write, read back and delete a probe object: ``RemoteUnavailableError`` with the
        full cause if the bucket is missing, the keys are wrong or the server is away."""
        key = f"{self.prefix}/.probe/{uuid.uuid4().hex}" if self.prefix else f".probe/{uuid.uuid4().hex}"
        try:
            self._obs.put(self._store, key, b"probe")
            if bytes(self._obs.get(self._store, key).bytes()) != b"probe":
                raise RemoteUnavailableError(
                    f"object store {self.url}: a probe object read back wrong", unreachable=False
                )
            self._obs.delete(self._store, key)
        except RemoteUnavailableError:
            raise
        except Exception as exc:
            raise self._unavailable("write a probe object", key, exc) from exc

    def _unavailable(self, what: str, key: str, exc: BaseException) -> RemoteUnavailableError:
        # The whole cause (the first lines of an S3 error are often generic), on one line,
        # without obstore's debug dump of the same response.
        text = " ".join(str(exc).split(" Debug source:")[0].split())[:2000] or type(exc).__name__
        if "NoSuchBucket" in str(exc) or "bucket does not exist" in str(exc).lower():
            return RemoteUnavailableError(
                f"object store {self.url}: bucket {self.bucket!r} does not exist; create it first",
                unreachable=False,
            )
        for code, hint in KEY_ERRORS.items():
            if code in text:
                return RemoteUnavailableError(
                    f"object store {self.url}: {hint}. The server said: {text}", unreachable=False
                )
        if any(sign in text for sign in UNREACHABLE):
            return RemoteUnavailableError(
                f"object store {self.url}: could not {what}: unreachable (no answer from its endpoint in "
                f"time). Check that the S3 server runs and that the URL's endpoint (scheme http/https, host, "
                f"port) reaches it from this host. The client said: {text}"
            )
        if "AccessDenied" in text or "lacked the necessary privileges" in text:
            text = (
                f"access denied: bucket {self.bucket!r} does not exist, or these credentials (AWS_* "
                f"variables) may not use it. The server said: {text}"
            )
        # The server answered, with an error of its own: a setting (or the server) to fix.
        return RemoteUnavailableError(
            f"object store {self.url}: could not {what} {key}: {text}", unreachable=False
        )
