"""What an object store's failure says: a store that does not answer in time (the soak's
SeaweedFS under load: obstore's ``reqwest`` timeout) is unreachable, which the engine's start
tells from a wrong setting (``open_store``: start it, or fix the setting)."""

from __future__ import annotations

from langchain_agent_memory.engine.storage.objects import ObjectBlocks

#: The error obstore raised for a probe PUT that timed out (soak, 12-07), shortened.
TIMED_OUT = (
    "Generic S3 error: Error performing PUT http://127.0.0.1:20562/soak/kv/.probe/dccb9f in 5.0s - "
    "tryErrorImpl { method: PUT, retries: 0, max_retries: 1, elapsed: 5.001884461s, retry_timeout: 5s, "
    "inner: Http( HttpError { kind: Timeout, source: reqwest::Error { kind: Request, "
    "source: TimedOut, }, }, ), }"
)


def test_a_probe_that_timed_out_is_unreachable_and_a_wrong_key_is_not() -> None:
    objects = ObjectBlocks("s3://soak/kv?endpoint=http://127.0.0.1:20562")
    timed_out = objects._unavailable("write a probe object", ".probe/x", RuntimeError(TIMED_OUT))
    assert timed_out.unreachable and "S3 server runs" in str(timed_out)
    for answer in ("InvalidAccessKeyId", "NoSuchBucket", "AccessDenied", "InternalError"):
        refused = objects._unavailable("write a probe object", ".probe/x", RuntimeError(answer))
        assert not refused.unreachable and "unreachable" not in str(refused), answer
    wrong_key = str(
        objects._unavailable("write a probe object", ".probe/x", RuntimeError("InvalidAccessKeyId"))
    )
    assert "AWS_ACCESS_KEY_ID" in wrong_key
