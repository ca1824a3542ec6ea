"""``agent-memory models``: the models on disk (shipped, converted, in the Hugging Face
cache), the families of the installed mlx-lm with the test matrix's verdict, and
``--check DIR``: a model's structure and self-check against mlx-lm's own forward."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..config import get_settings
from .common import CacheDir, wide_console


def _on_disk(cache_dir: Path | None) -> list[dict[str, Any]]:
    from ..engine import SHIPPED_MODELS

    rows: list[dict[str, Any]] = [
        {"name": m.name, "kind": "shipped", "context": m.context_length, "about": m.description}
        for m in SHIPPED_MODELS.values()
    ]
    converted = Path(cache_dir or get_settings().cache_dir).expanduser() / "models"
    found = [("converted", str(d), d) for d in sorted(converted.glob("*")) if (d / "config.json").exists()]
    found += [("hub cache", repo, d) for repo, d in _hub_models()]
    for kind, name, d in found:
        try:
            config = json.loads((d / "config.json").read_text())
        except (OSError, ValueError):
            continue
        text = config.get("text_config") or {}
        context = config.get("max_position_embeddings") or text.get("max_position_embeddings")
        rows.append({"name": name, "kind": kind, "context": context, "about": config.get("model_type", "")})
    return rows


def _hub_models() -> list[tuple[str, Path]]:
    """Models in the Hugging Face cache (``HF_HOME``) with an mlx-lm ``config.json``: usable
    by repo id, offline too."""
    try:
        from huggingface_hub import scan_cache_dir

        from ..engine import hub_cache_dir

        info = scan_cache_dir(hub_cache_dir())
    except Exception:  # no cache yet, or one huggingface_hub cannot read: nothing to list
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        newest = max(repo.revisions, key=lambda r: r.last_modified, default=None)
        if (
            repo.repo_type == "model"
            and newest is not None
            and (newest.snapshot_path / "config.json").exists()
        ):
            out.append((repo.repo_id, newest.snapshot_path))
    return out


def _families() -> tuple[str, list[dict[str, str]]]:
    from ..engine import recorded_verdicts

    recorded = recorded_verdicts()
    rows = [{"family": f, **row} for f, row in recorded["families"].items()]
    return str(recorded["mlx_lm"]), rows


def models(
    cache_dir: CacheDir = None,
    format: Annotated[str, typer.Option("--format", help="table or json")] = "table",
    check: Annotated[
        str | None,
        typer.Option(
            "--check",
            metavar="MODEL",
            help="Check one model (a directory, repo id, shipped name or .gguf): its caches and "
            "its self-check against mlx-lm's own forward; exit 1 if refused",
        ),
    ] = None,
) -> None:
    """List the models on disk (shipped, converted, in the Hugging Face cache) and the model
    families of the installed mlx-lm with the verdict the test matrix recorded; or check one
    model with ``--check``."""
    if format not in ("table", "json"):
        raise typer.BadParameter("give table or json", param_hint="--format")
    if check is not None:
        raise typer.Exit(_check(check, cache_dir, format))
    disk = _on_disk(cache_dir)
    version, families = _families()
    installed = importlib.metadata.version("mlx-lm")
    if format == "json":
        typer.echo(
            json.dumps({"models": disk, "families": families, "recorded_on_mlx_lm": version}, indent=2)
        )
        return
    console = wide_console()
    table = Table(title="models")
    for col in ("name", "kind", "context", "about"):
        table.add_column(col)
    for r in disk:
        table.add_row(r["name"], r["kind"], str(r["context"] or "?"), r["about"])
    console.print(table)
    runs = sum(1 for r in families if r["verdict"] == "runs")
    title = f"model families of mlx-lm {installed}: {runs} of {len(families)} run"
    if version != installed:
        title += (
            f" (verdicts recorded on mlx-lm {version}: a model of another family is checked when it loads)"
        )
    fams = Table(title=title)
    for col in ("family", "caches", "verdict"):
        fams.add_column(col)
    for r in families:
        verdict = r["verdict"] if not r["reason"] else f"{r['verdict']}: {r['reason']}"
        fams.add_row(r["family"], r["kinds"], verdict)
    console.print(fams)


def _check(model: str, cache_dir: Path | None, format: str) -> int:
    from ..engine import UnsupportedModelError, load_model

    try:
        loaded = load_model(model, cache_dir=cache_dir, recheck=True)
    except UnsupportedModelError as exc:
        if format == "json":
            typer.echo(json.dumps({"model": model, "verdict": "refused", "reason": str(exc)}, indent=2))
        else:
            wide_console().print(f"[red]refused[/red]: {exc}")
        return 1
    layout, result = loaded.structure.layout, loaded.check
    assert result is not None
    out = {
        "model": model,
        "directory": str(loaded.path),
        "verdict": "runs",
        "caches": layout.summary(),
        "self_check": {"max_error": result.max_error, "tolerance": result.tolerance, "runs": result.runs},
    }
    if format == "json":
        typer.echo(json.dumps(out, indent=2))
        return 0
    console = wide_console()
    console.print(f"[green]runs[/green]: {model} ({loaded.path})")
    console.print(f"  caches: {out['caches']}")
    console.print(f"  self-check against mlx-lm's own forward: {result.summary()}")
    for name, error in result.runs.items():
        console.print(f"    {name}: max logit error {error:.2e}")
    return 0
