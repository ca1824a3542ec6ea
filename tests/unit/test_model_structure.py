"""Support by structure: a model's own cache list decides how the engine stores each layer;
a cache kind it cannot store is refused naming the layer and the kind; the self-check
refuses a model whose code over the engine's caches computes something else than over
mlx-lm's own (random weights, tiny configs built here)."""

from __future__ import annotations

from typing import Any

import pytest
from mlx_lm.models import cache as mc
from mlx_lm.models import llama

from langchain_agent_memory.engine.model import self_check as checks
from langchain_agent_memory.engine.model.forward import LAST, ModelForward
from langchain_agent_memory.engine.model.structure import (
    UnsupportedModelError,
    decoder_stack,
    describe,
    layout_of,
)
from langchain_agent_memory.engine.ops.runtime import mx


def _llama(layers: int = 2) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=layers, intermediate_size=128,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5, vocab_size=300,
    )  # fmt: skip
    mx.random.seed(3)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


class _OwnCache(mc.KVCache):
    """A cache class of a model's own (as a future family might bring)."""


def test_a_cache_kind_the_engine_cannot_store_is_refused_naming_the_layer_and_kind() -> None:
    model = _llama(3)
    model.make_cache = lambda: [mc.KVCache(), _OwnCache(), mc.KVCache()]
    with pytest.raises(UnsupportedModelError, match=r"layer 1 is a .*_OwnCache, a cache kind"):
        layout_of(model)
    model.make_cache = lambda: [mc.KVCache(), mc.RotatingKVCache(max_size=32, keep=4), mc.KVCache()]
    with pytest.raises(UnsupportedModelError, match=r"layer 1 is a RotatingKVCache\(32, keep=4\)"):
        layout_of(model)


def test_sliding_and_recurrent_and_paired_layers_map_to_a_flat_list() -> None:
    model = _llama(3)
    pair = mc.CacheList(mc.ArraysCache(size=2), mc.KVCache())
    model.make_cache = lambda: [mc.RotatingKVCache(max_size=16), pair, mc.KVCache()]
    layout, _, windows = layout_of(model)
    assert layout.entries == (0, (1, 2), 3)
    assert layout.kinds == ("RotatingKVCache(16)", "ArraysCache", "KVCache", "KVCache")
    assert windows == [16, "state", None, None]
    flat = ["a", "b", "c", "d"]
    built = layout.assemble(flat)
    assert built[0] == "a" and built[2] == "d" and isinstance(built[1], mc.CacheList)
    assert list(built[1].caches) == ["b", "c"]


def test_the_decoder_stack_is_found_by_what_it_holds() -> None:
    model = _llama()
    assert decoder_stack(model) is model.model


def test_the_engine_runs_the_models_own_head() -> None:
    """Whatever the model's ``__call__`` does after its decoder stack (here a soft-cap and
    a scale, as Gemma 2 and Granite do) is in the engine's logits: cut to the last row,
    they equal the model's own."""

    class Capped(llama.Model):
        def __call__(self, inputs: mx.array, cache: Any = None, **kw: Any) -> mx.array:
            out = super().__call__(inputs, cache=cache, **kw)
            return mx.tanh(out / 0.5) * 0.5 / 3.0

    model = Capped(_llama().args)
    model.update(_llama().parameters())
    structure = describe(model)
    ids = mx.array([[5, 6, 7, 8, 9]])
    theirs = model(ids, cache=mc.make_prompt_cache(model))[:, -1:]
    ours = ModelForward(model, structure.layout)(ids, mc.make_prompt_cache(model), LAST)
    assert ours.shape == theirs.shape and mx.allclose(ours, theirs, atol=1e-6).item()


def test_the_self_check_passes_a_model_that_attends_through_its_caches() -> None:
    model = _llama()
    structure = describe(model)
    result = checks.check(model, structure, checks.reference(model, structure), checks.MLX_RUNS)
    assert result.passed and result.max_error < 1e-3, result.summary()


def test_the_self_check_refuses_a_model_that_keeps_state_outside_its_cache() -> None:
    """A layer that also remembers something itself (here: how many calls it has seen,
    outside the cache it is given) answers one way over mlx-lm's caches and another over
    the engine's: refused, naming the step; one that keeps nothing in its cache at all is
    refused by the structure probe already."""
    model = _llama()
    attention = model.model.layers[1].self_attn
    original = type(attention)

    class Remembers(original):  # type: ignore[misc, valid-type]
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            self.__dict__["calls"] = self.__dict__.get("calls", 0) + 1
            return super().__call__(x, mask, cache) * (1 + 0.1 * self.__dict__["calls"])

    attention.__class__ = Remembers
    structure = describe(model)
    ref = checks.reference(model, structure)
    result = checks.check(model, structure, ref, checks.MLX_RUNS)
    assert not result.passed and result.max_error > result.tolerance
    assert result.worst.startswith("mlx-lm attention"), result.summary()
    with pytest.raises(UnsupportedModelError, match="differs from mlx-lm's own"):
        raise checks.refusal("remembers", result)


def test_a_cache_the_model_never_fills_is_no_slot_of_the_engines() -> None:
    """A layer that attends without its cache (as Nemotron-NAS's layers without attention
    leave theirs empty) gets no slot: the engine stores the other layers, and the model
    computes over its caches what it computes over mlx-lm's; a model that fills none of
    its caches keeps its keys elsewhere: refused."""
    model = _llama(3)
    for layer in (1, 2):
        attention = model.model.layers[layer].self_attn

        class KeepsNothing(type(attention)):  # type: ignore[misc]
            def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
                return super().__call__(x, "causal" if x.shape[1] > 1 else None, None)

        attention.__class__ = KeepsNothing
        if layer == 1:
            structure = describe(model)
            assert structure.layout.entries == (0, None, 1) and structure.spec.num_layers == 2
            assert structure.layout.summary() == "KVCache ×2, unused"
    model.model.layers[0].self_attn.__class__ = type(model.model.layers[1].self_attn)
    with pytest.raises(UnsupportedModelError, match="no cache holds anything after a forward pass"):
        describe(model)


def test_the_self_check_refuses_a_model_whose_code_fails_over_the_engines_caches() -> None:
    model = _llama()
    attention = model.model.layers[0].self_attn
    original = type(attention)

    class ReadsTheBuffer(original):  # type: ignore[misc, valid-type]
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            out = super().__call__(x, mask, cache)
            return out + 0 * cache.keys[..., : cache.offset, :].sum()  # mlx-lm's KVCache buffer

    attention.__class__ = ReadsTheBuffer
    structure = describe(model)
    result = checks.check(model, structure, checks.reference(model, structure), checks.MLX_RUNS)
    assert not result.passed and "fails over the engine's caches" in result.differs
