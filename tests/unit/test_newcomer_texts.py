"""What a newcomer reads where the docs meet the code (issue 66, tried 12-06): the hint
for a missing extra is a command that works (the package is not on PyPI, so
``pip install 'langchain-agent-memory[server]'`` fails), and ``ChatAgentMemory(model=...)``
says it takes a Hugging Face repo id, as ``agent-memory models --check`` does."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement

from langchain_agent_memory import ChatAgentMemory
from langchain_agent_memory.server import install_hint

ROOT = Path(__file__).resolve().parents[2]


def test_the_server_extras_hint_installs_its_requirements_not_the_unpublished_package() -> None:
    hint = install_hint("server")
    assert "langchain-agent-memory[" not in hint, hint
    for requirement in ("fastapi", "uvicorn", "sse-starlette"):
        assert requirement in hint, hint
    # a pip command whose every argument is a requirement (``Requirement`` raises if not)
    assert hint.startswith("pip install '")
    assert [Requirement(a.strip("'")).name for a in hint.split()[2:]]


def test_the_model_parameter_names_repo_ids() -> None:
    assert "mlx-community/" in (ChatAgentMemory.__doc__ or "")
    assert "repo id" in (ROOT / "docs" / "guides" / "chat-model.md").read_text()


def test_the_backend_hints_install_mlxs_backend_not_the_unpublished_package() -> None:
    """What ``engine.ops.runtime`` says when mlx loads no backend: ``[cpu]`` / ``[cuda]`` of
    an unpublished package failed; the extras' own requirements install."""
    source = (ROOT / "langchain_agent_memory" / "engine" / "ops" / "runtime.py").read_text()
    assert "langchain-agent-memory[" not in source
    for extra, wanted in (("cpu", "mlx[cpu]"), ("cuda", "mlx[cuda13]")):
        hint = install_hint(extra)
        assert wanted in hint and "langchain-agent-memory[" not in hint, hint
