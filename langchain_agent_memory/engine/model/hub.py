"""Hugging Face repo ids as model names, resolved the way ``mlx_lm.load`` resolves them:
``huggingface_hub.snapshot_download`` with mlx-lm's allow patterns, into the Hugging Face
cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``), offline under ``HF_HUB_OFFLINE=1``.

A model name is ``org/name`` or ``org/name@revision`` (a branch, a tag or a commit hash;
``@`` cannot occur in a repo id, and a revision may hold ``/``, as ``refs/pr/1`` does).

>>> parse_repo_id("mlx-community/Qwen3-30B-A3B-4bit@refs/pr/1")
('mlx-community/Qwen3-30B-A3B-4bit', 'refs/pr/1')
>>> parse_repo_id("mlx-community/Qwen3-30B-A3B-4bit")
('mlx-community/Qwen3-30B-A3B-4bit', None)
>>> [parse_repo_id(s) for s in ("smollm2-135m", "./models/qwen", "/opt/models/qwen", "org/model.gguf")]
[None, None, None, None]
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from huggingface_hub import constants, get_cached_repo_tree, snapshot_download
from huggingface_hub.errors import (
    CachedRepoTreeNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

logger = logging.getLogger(__name__)

REVISION_SEP = "@"
_LOGIN = "log in with `hf auth login` or set HF_TOKEN"


def parse_repo_id(name: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``name`` reads as ``org/name[@revision]``, else None.

    The namespace is required (a bare ``qwen3`` is a typo more often than a legacy repo),
    and a name ending in ``.gguf`` is a file, not a repo.
    """
    repo_id, sep, revision = name.partition(REVISION_SEP)
    if (sep and not revision) or repo_id.count("/") != 1 or repo_id.endswith(".gguf"):
        return None
    try:
        validate_repo_id(repo_id)  # huggingface_hub's own rules: the Hub would refuse the rest
    except HFValidationError:
        return None
    return repo_id, revision or None


# NOTE: huggingface_hub reads HF_HOME / HF_HUB_CACHE / HF_HUB_OFFLINE once, when it is
# imported; they are read again here, at each call, so that a process (or a test) that sets
# them later is obeyed too. The defaults are huggingface_hub's (constants.py).
def hub_cache_dir() -> Path:
    """The Hugging Face cache that snapshots are read from and downloaded into."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        default_home = os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
        cache = os.path.join(os.environ.get("HF_HOME", default_home), "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def snapshot_repo(commit: str) -> str | None:
    """The repo id whose snapshot in the Hugging Face cache is this commit, or None. A repo
    id's model is read from ``.../models--org--name/snapshots/<commit>``, so its caches'
    fingerprint starts with the commit hash: this names the repo for people.

    >>> snapshot_repo("smollm2-135m") is None  # not a commit hash: no lookup
    True
    """
    if len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        return None
    for snapshot in hub_cache_dir().glob(f"models--*/snapshots/{commit}"):
        # huggingface_hub's folder name: "models--" + the id with "/" as "--" (an id holds no "--")
        return snapshot.parent.parent.name.removeprefix("models--").replace("--", "/", 1)
    return None


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``), now or when huggingface_hub was imported."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in constants.ENV_VARS_TRUE_VALUES or constants.is_offline_mode()


def _allow_patterns() -> list[str]:
    # Imported here: mlx_lm.utils pulls in transformers (~0.6 s), which a profile lookup skips.
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    return list(DEFAULT_ALLOW_PATTERNS)


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The complete local snapshot of ``repo_id`` at ``revision``, or None; never downloads
    (mlx-lm's ``hf_repo_to_path``, with a revision and the cache read at call time)."""
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=hub_cache_dir(),
                allow_patterns=_allow_patterns(),
                local_files_only=True,
            )
        )
    except LocalEntryNotFoundError:  # absent, or incomplete (an interrupted download)
        return None


def snapshot_dir(repo_id: str, revision: str | None = None) -> Path:
    """The local mlx-lm model directory of ``repo_id`` at ``revision`` (the default branch
    when None), downloading the files mlx-lm loads where they are missing.

    Online, the Hub is asked which commit ``revision`` is now (as ``mlx_lm.load`` does), so a
    moved branch is followed; under ``HF_HUB_OFFLINE=1`` only the cache is read. Every
    failure the caller can fix is a ``ValueError`` that says how.
    """
    cache = hub_cache_dir()
    offline = hub_offline()
    where = repo_id + (f"{REVISION_SEP}{revision}" if revision else "")
    cached = None if offline else cached_snapshot(repo_id, revision)
    if not offline and cached is None:
        logger.info("downloading %s from the Hugging Face Hub into %s", where, cache)
    try:
        path = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=cache,
                allow_patterns=_allow_patterns(),
                local_files_only=offline,
            )
        )
    except GatedRepoError as exc:
        raise ValueError(
            f"model {where!r} is gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/{repo_id}, then {_LOGIN}"
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ValueError(
            f"model {where!r}: no such repo on the Hugging Face Hub, or it is private. Check the "
            f"name (org/name, as on https://huggingface.co/); for a private repo, {_LOGIN}"
        ) from exc
    except RevisionNotFoundError as exc:
        raise ValueError(
            f"model {where!r}: the repo has no revision {revision!r}; give a branch, a tag or a commit hash"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise ValueError(_not_cached(repo_id, revision, cache, offline, exc)) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = _LOGIN if status in (401, 403) else "try again later, or download it with `hf download`"
        raise ValueError(f"model {where!r}: the Hugging Face Hub answered HTTP {status}: {hint}") from exc
    if cached is not None and path != cached:
        logger.info("%s moved on the Hub: downloaded commit %s into %s", where, path.name, cache)
    return _require_config(path, repo_id, where, cache)


def _not_cached(
    repo_id: str, revision: str | None, cache: Path, offline: bool, exc: LocalEntryNotFoundError
) -> str:
    where = repo_id + (f"{REVISION_SEP}{revision}" if revision else "")
    state = "is only partly in" if isinstance(exc, IncompleteSnapshotError) else "is not in"
    download = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    if offline or isinstance(exc.__cause__, OfflineModeIsEnabled):
        return (
            f"model {where!r} {state} the Hugging Face cache at {cache} and HF_HUB_OFFLINE=1 "
            f"forbids downloading it: download it first with {download} (the same HF_HOME), "
            "or unset HF_HUB_OFFLINE"
        )
    return (
        f"model {where!r} {state} the Hugging Face cache at {cache} and the Hub could not be "
        f"reached (no network?): connect and retry, or download it where there is a network with "
        f"{download} and copy that HF_HOME here"
    )


def _require_config(path: Path, repo_id: str, where: str, cache: Path) -> Path:
    """``path`` when it holds an mlx-lm model (a config.json); else a ValueError that says what
    the repo holds instead (a GGUF repo: its files are listed by the cached tree or on disk)."""
    if (path / "config.json").is_file():
        return path
    ggufs = {str(p.relative_to(path)) for p in path.rglob("*.gguf")} if path.is_dir() else set()
    try:
        tree = get_cached_repo_tree(repo_id, revision=path.name, cache_dir=cache)
        ggufs |= {f.path for f in tree if f.path.endswith(".gguf")}
    except CachedRepoTreeNotFoundError:  # no listing cached (offline, or a cache laid by hand)
        pass
    if ggufs:
        first = sorted(ggufs)[0]
        raise ValueError(
            f"model {where!r} holds GGUF files ({', '.join(sorted(ggufs)[:3])}) but no config.json: "
            "a GGUF repo on the Hub is not converted here. Use its mlx-lm conversion (search "
            "https://huggingface.co/mlx-community), or download one file with "
            f"`hf download {repo_id} {first} --local-dir DIR` and give model='DIR/{first}' "
            "(llama and gemma3 GGUFs convert)"
        )
    raise ValueError(
        f"model {where!r} is not an mlx-lm model repo: its snapshot at {path} has no config.json"
    )
