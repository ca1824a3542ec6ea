"""Store URLs in messages and logs: secrets masked wherever the URL holds them."""

from __future__ import annotations

import pytest

from langchain_agent_memory.engine.storage.urls import redacted


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://worker:pw@db.example:5432/agents", "postgresql://worker:***@db.example:5432/agents"),
        (
            "postgresql:///agents?host=/run/pg&user=w&password=pw",
            "postgresql:///agents?host=/run/pg&user=w&password=***",
        ),
        (
            "s3://bucket/kv?endpoint=http://h:8333&access_key_id=AK&secret_access_key=SK&session_token=T",
            "s3://bucket/kv?endpoint=http://h:8333&access_key_id=AK&secret_access_key=***&session_token=***",
        ),
        ("postgresql://worker@db/agents", "postgresql://worker@db/agents"),  # nothing secret: as given
        ("s3://bucket/kv", "s3://bucket/kv"),
    ],
)
def test_secrets_are_masked_and_the_rest_kept(url: str, shown: str) -> None:
    assert redacted(url) == shown
