"""Sliding-window layers (Gemma 3: window 512 on 15 of 18 layers) with our quantized
caches agree with mlx-lm's FP16 RotatingKVCache on a 2K-token prompt, and ignoring the
window is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine.kv import KVQuant, make_layer_caches
from langchain_agent_memory.engine.model.forward import decode_step, prefill
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.engine.ops.runtime import mx

N_TOKENS = 2048


@pytest.fixture(scope="module")
def reference(gemma: LoadedModel) -> tuple[list[int], mx.array, mx.array]:
    """Logits after a 2K prompt and after one more token, with mlx-lm's own caches."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    ids = gemma.tokenizer.encode(corpus.python_docs())[:N_TOKENS]
    caches = make_prompt_cache(gemma.model)
    assert sum(isinstance(c, RotatingKVCache) for c in caches) == 15
    last = prefill(gemma.model, ids, caches)
    step = decode_step(gemma.model, 42, caches)
    mx.eval(last, step)
    return ids, last, step


def _ours(
    gemma: LoadedModel, ids: list[int], bits: int | None, ignore_window: bool
) -> tuple[mx.array, mx.array]:
    spec = gemma.structure.spec
    layers = make_layer_caches(spec, KVQuant.uniform(bits))
    if ignore_window:  # the bug this test exists for: a causal-only mask on sliding layers
        for layer in layers:
            layer.spec = replace(layer.spec, window=None)
    half = len(ids) // 2
    prefill(gemma.model, ids[:half], layers)
    for layer in layers:
        layer.commit()  # the second half attends to the stored (quantized) first half
    last = prefill(gemma.model, ids[half:], layers)
    for layer in layers:
        layer.commit()
    step = decode_step(gemma.model, 42, layers)
    mx.eval(last, step)
    return last, step


def _rel(a: mx.array, b: mx.array) -> float:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item()


@pytest.mark.parametrize(("bits", "tolerance"), [(None, 2e-3), (8, 0.05), (4, 0.25)])
def test_window_aware_caches_match_rotating_fp16(gemma: LoadedModel, reference, bits, tolerance) -> None:
    ids, ref_last, ref_step = reference
    last, step = _ours(gemma, ids, bits, ignore_window=False)
    # Measured (2K tokens): fp16 ~1e-4, 8-bit ~0.01, 4-bit ~0.07-0.15 relative error.
    assert _rel(last, ref_last) < tolerance
    assert _rel(step, ref_step) < tolerance
    assert mx.argmax(last).item() == mx.argmax(ref_last).item()


def test_ignoring_the_window_is_caught(gemma: LoadedModel, reference) -> None:
    ids, ref_last, ref_step = reference
    last, step = _ours(gemma, ids, None, ignore_window=True)
    assert _rel(last, ref_last) > 0.3  # measured ~0.6: far outside every tolerance above
    assert _rel(step, ref_step) > 0.3


def test_a_sliding_layers_working_copy_stays_about_a_window_long(gemma: LoadedModel) -> None:
    """Through a 2K-token prefill in 256-token chunks, a sliding layer's full-precision
    copy holds its window and about a chunk (its memory does not grow with the context);
    a full layer's holds every token."""
    from langchain_agent_memory.engine.kv.buffers import WORK_STEP

    spec = gemma.structure.spec
    layers = make_layer_caches(spec, KVQuant.uniform(4))
    ids = gemma.tokenizer.encode(corpus.python_docs())[:N_TOKENS]
    prefill(gemma.model, ids, layers, chunk_tokens=256)
    for layer in layers:
        row = layer.spec.kv_heads * (layer.spec.k_head_dim + layer.spec.v_head_dim) * 4  # K and V, float32
        window = layer.spec.window
        if window is None:
            assert layer.work_nbytes >= N_TOKENS * row
        else:
            assert layer.work_nbytes <= (window + 256 + 2 * WORK_STEP) * row, layer.work_nbytes // row


def test_a_warm_restore_past_the_window_equals_the_uninterrupted_run(gemma: LoadedModel, tmp_path) -> None:
    """At 16-bit KV the oracle holds exactly: a new engine restoring a 1.5K-token context
    (its sliding layers read only their last window's blocks, the full layers every block)
    continues with the same greedy tokens as the engine that never stopped."""
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    text = gemma.tokenizer.decode(
        gemma.tokenizer.encode(corpus.python_docs(), add_special_tokens=False)[:1500]
    )
    params = GenerationParams(max_tokens=8)
    hot = Engine("gemma3-270m", cache_dir=tmp_path / "hot", kv_bits=None)
    first = hot.generate("g", text, params)
    more = text + first.text + "\n\nIn short,"
    uninterrupted = hot.generate("g", more, params)
    cold_dir = tmp_path / "warm"
    warm = Engine("gemma3-270m", cache_dir=cold_dir, kv_bits=None)
    assert warm.generate("g", text, params).text == first.text
    warm.close()
    again = Engine("gemma3-270m", cache_dir=cold_dir, kv_bits=None)
    resumed = again.generate("g", more, params)
    assert resumed.outcome.source.value == "warm" and resumed.reused_tokens >= 1500
    assert resumed.text == uninterrupted.text
    hot.close()
    again.close()


def test_a_diverge_before_the_window_equals_a_cold_run(gemma: LoadedModel, tmp_path) -> None:
    """A turn that goes back ~100 tokens before the end of the last one: the sliding layers
    kept only their window and read the older tokens from the blocks, the full layers keep
    what they hold in memory. At 16-bit KV the reply equals a cold run of the same prompt."""
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    ids = gemma.tokenizer.encode(corpus.python_docs(), add_special_tokens=False)
    text = gemma.tokenizer.decode(ids[:1500])
    params = GenerationParams(max_tokens=8)
    live = Engine("gemma3-270m", cache_dir=tmp_path / "live", kv_bits=None)
    live.generate("g", text, params)
    back = gemma.tokenizer.decode(ids[:1400]) + "\n\nTo sum up the section above,"
    diverged = live.generate("g", back, params)
    assert str(diverged.outcome) == "hot-diverge"
    assert 1300 <= diverged.reused_tokens < 1500
    cold = Engine("gemma3-270m", cache_dir=tmp_path / "cold", kv_bits=None)
    assert cold.generate("g", back, params).text == diverged.text
    live.close()
    cold.close()
