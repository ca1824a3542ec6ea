"""The model fingerprint: what a stored cache is valid for.

A cache holds one model's keys and values in one KV format: read under any other model it
is garbage that still loads. So the fingerprint hashes the weights' *content* (two
fine-tunes of one base share names and shapes), the config, the KV layout and the KV
format with its rotation scheme. Hashing gigabytes of weights is done once per file: the
digest is remembered by (path, size, mtime) in this process and in
``<cache_dir>/models/weight-digests.json`` across processes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from ..kv import KVQuant
from ..kv.spec import ModelCacheSpec
from ..ops.files import atomic_write_bytes

_DIGESTS_FILE = "weight-digests.json"
_memo: dict[tuple[str, int, int], str] = {}


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 4 MB pieces."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(path: Path, memo_dir: Path | None = None) -> str:
    """SHA-256 of one weights file, hashed once per (path, size, mtime)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    known = _memo.get(key)  # one dict operation each: atomic, no lock (two threads may hash it twice)
    if known is not None:
        return known
    memo_file = memo_dir / _DIGESTS_FILE if memo_dir is not None else None
    stored = _read_memo(memo_file)
    entry = stored.get(key[0])
    if entry is not None and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        digest = str(entry["sha256"])
    else:
        digest = sha256_file(path)
        if memo_file is not None:
            stored = {p: e for p, e in stored.items() if Path(p).exists()}  # forget deleted models
            stored[key[0]] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
            _write_memo(memo_file, stored)
    _memo[key] = digest
    return digest


def _read_memo(memo_file: Path | None) -> dict[str, dict[str, object]]:
    if memo_file is None:
        return {}
    try:
        data = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: hash again, rewrite it
    return data if isinstance(data, dict) else {}


def _write_memo(memo_file: Path, data: dict[str, dict[str, object]]) -> None:
    # Only a memo: a failed write costs a second hash later, nothing else.
    with contextlib.suppress(OSError):
        atomic_write_bytes(memo_file, json.dumps(data, indent=1, sort_keys=True).encode())


def model_fingerprint(
    model_dir: Path, spec: ModelCacheSpec, quant: KVQuant, memo_dir: Path | None = None
) -> str:
    """Identity of (weights, config, KV layout, KV format): caches are only valid under it."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(weights_digest(f, memo_dir).encode())
    h.update(spec.to_json().encode())
    h.update(quant.identity.encode())
    return f"{model_dir.name[:40]}-{quant.label}-{h.hexdigest()[:16]}"
