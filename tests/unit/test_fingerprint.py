"""The model fingerprint hashes the weights' content: two models with the same directory
name, config and tensor shapes but other weights (two fine-tunes) never share a cache."""

from __future__ import annotations

import json
from pathlib import Path

from langchain_agent_memory.engine.kv import LayerSpec, ModelCacheSpec, kv_format
from langchain_agent_memory.engine.model.fingerprint import model_fingerprint, sha256_file
from langchain_agent_memory.engine.ops.runtime import mx

SPEC = ModelCacheSpec((LayerSpec(2, 64, 64, None),), "float32")


def _model(root: Path, value: float) -> Path:
    d = root / "my-finetune"  # the same name for both
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    mx.save_safetensors(str(d / "model.safetensors"), {"w": mx.full((4, 8), value)})
    return d


def test_same_names_and_shapes_with_other_weights_get_other_fingerprints(tmp_path: Path) -> None:
    a, b, a2 = _model(tmp_path / "a", 1.0), _model(tmp_path / "b", 2.0), _model(tmp_path / "c", 1.0)
    quant = kv_format(4)
    fa, fb = model_fingerprint(a, SPEC, quant), model_fingerprint(b, SPEC, quant)
    assert fa != fb
    assert model_fingerprint(a2, SPEC, quant) == fa  # the same content elsewhere: the same caches
    assert model_fingerprint(a, SPEC, kv_format(8)) != fa  # another KV format


def test_weight_digests_are_remembered_by_size_and_mtime(tmp_path: Path) -> None:
    a = _model(tmp_path, 1.0)
    memo = tmp_path / "memo"
    model_fingerprint(a, SPEC, kv_format(4), memo)
    stored = json.loads((memo / "weight-digests.json").read_text())
    entry = stored[str((a / "model.safetensors").resolve())]
    assert entry["sha256"] == sha256_file(a / "model.safetensors")
    assert entry["size"] == (a / "model.safetensors").stat().st_size
