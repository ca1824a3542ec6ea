"""Attention on the stored form (``kv.stored``) equals attention over the same keys and
values decoded to full precision: GQA folded into query rows, several segments (16-bit
head, quantized and rotated body, full-precision tail), causal and sliding-window masks,
attention sinks, and the decoded path a long prefill chunk takes.

The CUDA path (``kv.stored_cuda``) is checked in two halves: its kernels' source, run by
C++ threads on this CPU against their oracle (``test_stored_cuda_kernel.py``), and here the
call that hands a layer's segments to them (``kernel-merge``: the oracle stands in for the
kernels). On the H200 ``pytest -m gpu`` runs the kernels themselves."""

from __future__ import annotations

import mlx.core as mx
import pytest

from langchain_agent_memory.engine.kv import FULL, KV_PRESETS, positional_mask, stored_cuda
from langchain_agent_memory.engine.kv import stored as stored_module
from langchain_agent_memory.engine.kv.stored import decode_segment, stored_attention


def _segments(kv_heads: int, d: int, n_head: int, n_body: int, n_tail: int, fmt: str) -> list:
    quant = KV_PRESETS[fmt]
    key = mx.random.key(7)
    k1, k2 = mx.random.split(key)
    n = n_head + n_body + n_tail
    k = mx.random.normal((1, kv_heads, n, d), key=k1)
    v = mx.random.normal((1, kv_heads, n, d), key=k2)
    segments = []
    if n_head:
        segments.append(
            ((k[:, :, :n_head].astype(mx.float16),), (v[:, :, :n_head].astype(mx.float16),), FULL, FULL)
        )
    body = slice(n_head, n_head + n_body)
    segments.append(
        (quant.keys.encode(k[:, :, body]), quant.values.encode(v[:, :, body]), quant.keys, quant.values)
    )
    if n_tail:
        segments.append(((k[:, :, n_head + n_body :],), (v[:, :, n_head + n_body :],), FULL, FULL))
    return segments


def _reference(queries: mx.array, segments: list, scale: float, first_q: int, first_k: int, window, sinks):
    k = mx.concatenate([decode_segment(kp, kc, mx.float32) for kp, _, kc, _ in segments], axis=2)
    v = mx.concatenate([decode_segment(vp, vc, mx.float32) for _, vp, _, vc in segments], axis=2)
    mask = positional_mask(first_q, queries.shape[2], first_k, window, True)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


@pytest.fixture(params=["ops", "kernel-merge"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int] | None:
    """``ops``: this device's path (None); ``kernel-merge``: the CUDA path's merge, with the
    kernel's oracle computing the quantized segment's partial result (the list counts its
    calls)."""
    if request.param == "ops" or stored_cuda.available():
        return None
    calls: list[int] = []

    def oracle(*args: object, **kwargs: object) -> mx.array:
        calls.append(1)
        return stored_cuda.reference_attention(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(stored_cuda, "available", lambda: True)
    monkeypatch.setattr(stored_cuda, "attention", oracle)
    return calls


@pytest.mark.parametrize("fmt", ["k6v4-rot-h4", "q4", "q8", "fp16"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "L", "window"), [(8, 2, 1, None), (8, 2, 5, None), (4, 4, 3, 40), (6, 2, 1, 40)]
)
def test_stored_attention_equals_attention_over_the_decoded_keys(
    fmt: str, heads: int, kv_heads: int, L: int, window: int | None, path: list[int] | None
) -> None:
    d = 64
    segments = _segments(kv_heads, d, 4, 150, 10, fmt)
    n = 164
    first_q = n - L
    lo = 0 if window is None else max(0, first_q - window + 1)
    if lo:  # a sliding layer sees its window only: the held keys start there
        segments = [
            (
                tuple(x[:, :, lo - 4 :] for x in segments[1][0]),
                tuple(x[:, :, lo - 4 :] for x in segments[1][1]),
                *segments[1][2:],
            ),
            segments[2],
        ]
    queries = mx.random.normal((1, heads, L, d), key=mx.random.key(3))
    got = stored_attention(queries, segments, 0.125, first_q, lo, window)
    want = _reference(queries, segments, 0.125, first_q, lo, window, None)
    assert got.shape == want.shape == (1, heads, L, d)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    if path is not None and fmt != "fp16" and L == 1:  # decode steps take the kernel
        assert path


@pytest.mark.parametrize("L", [1, 3])
def test_the_16_bit_format_decodes_through_the_kernels(L: int, path: list[int] | None) -> None:
    """A 16-bit agent's decode step (its body and its request's tokens) takes the kernels
    as a quantized one does: over the unfused path every key and value was widened to
    float32 at every step (the 16-bit decode at 32K ran at a quarter of mlx-lm's speed)."""
    segments = _segments(2, 64, 0, 300, 6, "fp16")
    queries = mx.random.normal((1, 8, L, 64), key=mx.random.key(4))
    got = stored_attention(queries, segments, 0.125, 306 - L, 0, None, full_body=True)
    want = _reference(queries, segments, 0.125, 306 - L, 0, None, None)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    if path is not None:
        assert path  # rows of 2 tokens x 4 heads still fit one block


def test_attention_sinks_and_the_decoded_path_agree(
    monkeypatch: pytest.MonkeyPatch, path: list[int] | None
) -> None:
    segments = _segments(2, 64, 4, 100, 6, "k6v4-rot-h4")
    queries = mx.random.normal((1, 8, 3, 64), key=mx.random.key(5))
    sinks = mx.random.normal((8,), key=mx.random.key(6))
    want = _reference(queries, segments, 0.125, 107, 0, None, sinks)
    scores = stored_attention(queries, segments, 0.125, 107, 0, None, sinks)
    monkeypatch.setattr(stored_module, "SCORES_MAX", 0)  # every call takes the decoded path
    decoded = stored_attention(queries, segments, 0.125, 107, 0, None, sinks)
    assert mx.allclose(scores, want, atol=1e-4, rtol=1e-4).item()
    assert mx.allclose(decoded, want, atol=1e-4, rtol=1e-4).item()
    assert path is None or path


def test_a_left_padded_batch_equals_each_member_alone(path: list[int] | None) -> None:
    """``StoredBatch``'s call: members' regions right-aligned, ``valid`` and ``row_starts``
    say what each row holds; every row equals its member attended alone."""
    d, kv_heads, heads = 64, 2, 8
    members = [_segments(kv_heads, d, 4, n, 1, "k6v4-rot-h4") for n in (150, 70)]
    n_body = 150

    def left(x: mx.array, width: int) -> mx.array:
        return mx.pad(x, [(0, 0), (0, 0), (width - x.shape[2], 0), (0, 0)])

    batch = [
        tuple(
            tuple(
                mx.concatenate([left(m[i][side][j], width) for m in members])
                for j in range(len(members[0][i][side]))
            )
            for side in (0, 1)
        )
        for i, width in ((0, 4), (1, n_body), (2, 1))
    ]
    segments = [(*pair, *members[0][i][2:]) for i, pair in enumerate(batch)]
    cols = mx.arange(4 + n_body + 1)[None]
    first_body = mx.array([0, n_body - 70], dtype=mx.int32)
    valid = (cols < 4) | (cols >= 4 + first_body[:, None])
    queries = mx.random.normal((2, heads, 1, d), key=mx.random.key(9))
    row_starts = mx.array([[0, 0, 0, stored_cuda.ALL_VISIBLE], [n_body - 70, 0, 0, stored_cuda.ALL_VISIBLE]])
    got = stored_attention(
        queries, segments, 0.125, 0, 0, None, valid=valid, row_starts=row_starts.astype(mx.int32)
    )
    for i, m in enumerate(members):
        n = 4 + m[1][0][0].shape[2] + 1
        alone = stored_attention(queries[i : i + 1], m, 0.125, n - 1, 0, None)
        assert mx.allclose(got[i : i + 1], alone, atol=1e-4, rtol=1e-4).item()
    assert path is None or path


def test_the_kept_rotation_made_on_one_thread_serves_every_thread() -> None:
    """The rotation in a model's dtype is made once per process and kept: made on one thread
    (a model loaded and checked on the main one), it must serve the engine's worker, and a
    lazy array cannot be evaluated on another thread than the one that made it."""
    import threading

    stored = stored_module
    stored._rotation_as.cache_clear()
    stored._rotation_as(64, mx.float16)  # made here, never evaluated here
    got: dict[str, float] = {}

    def use() -> None:
        got["sum"] = (mx.ones((2, 64), mx.float16) @ stored._rotation_as(64, mx.float16)).sum().item()

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert "sum" in got  # the thread raised "There is no Stream(cpu, 0) in current thread" before
