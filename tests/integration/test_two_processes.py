"""Two processes on one cache directory at once, for real: an application running agent
turns and a cleanup process deleting those agents' caches and writing its own, over the
same shared blocks. Neither may corrupt the other: both finish without error, no damage
is ever detected, no record ever names a missing block (checked by both, under the lock,
after every step), and afterwards every record's blocks are present and verify, with the
index and the block files in agreement. With the directory lock made a no-op, two runs of
two found 1 record naming a deleted block each: the test sees the race it guards against."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from langchain_agent_memory.engine.engine import Engine, GenerationParams
from langchain_agent_memory.engine.model.loading import LoadedModel

CHILD = Path(__file__).parent / "concurrent_child.py"
SECONDS = "20"


def test_an_app_and_a_cleanup_process_share_a_cache_dir(
    smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    procs = {
        role: subprocess.Popen(
            [sys.executable, str(CHILD), role, str(tmp_path), SECONDS], stdout=subprocess.PIPE, text=True
        )
        for role in ("app", "cleanup")
    }
    outputs = {role: proc.communicate(timeout=300)[0] for role, proc in procs.items()}
    assert all(proc.returncode == 0 for proc in procs.values()), outputs
    summaries = {role: json.loads(out.strip().splitlines()[-1]) for role, out in outputs.items()}
    ops = {k: v for s in summaries.values() for k, v in s["ops"].items()}
    assert ops.get("cleanup deletes", 0) >= 10 and ops.get("cleanup turns", 0) >= 3
    assert sum(v for k, v in ops.items() if k.startswith("app turns")) >= 10
    assert "records naming a missing block" not in ops, ops
    warnings = [w for s in summaries.values() for w in s["warnings"]]
    # A load racing a delete may find its blocks gone (a fallback to prefill, said once);
    # nothing may ever be found damaged.
    assert not [w for w in warnings if "corrupt" in w or "checksum" in w or "unreadable" in w], warnings

    engine = Engine("smollm2-135m", cache_dir=tmp_path)  # opening recovers: nothing to recover
    store = engine.admin.store
    assert (store.recovery.temp_files_removed, store.recovery.missing_blocks) == (0, 0)
    assert store.recovery.orphan_blocks_removed == 0
    records = list(store.records.list())
    for record in records:
        for h in record.blocks:
            store.blocks.get(h)
    assert set(store.blocks.hashes()) == store.records.referenced_blocks()
    for record in records:  # and each cache resumes
        result = engine.generate(record.agent_id, record.text, GenerationParams(max_tokens=1))
        assert str(result.outcome).startswith("warm"), record.agent_id
    figures["two processes"] = (
        ", ".join(f"{v} {k}" for k, v in sorted(ops.items()))
        + f", {len(warnings)} fallbacks to prefill after a racing delete, 0 damage, "
        f"{len(records)} records and {len(store.records.referenced_blocks())} blocks verified after"
    )
