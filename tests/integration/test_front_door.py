"""The front door cannot rot: the README's code runs as pasted, its links and commands hold,
and the documentation site builds in strict mode."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from langchain_agent_memory.config import Settings

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
#: The port README's server example names (its client code and its `serve` line).
README_PORT = "8000"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def indented_commands() -> list[str]:
    """The README's shell commands: its 4-space indented lines."""
    return [line[4:] for line in README.splitlines() if line.startswith("    ") and line.strip()]


def test_the_readme_is_a_front_door() -> None:
    """At most 200 lines; every link into the repository names a file that exists."""
    assert len(README.splitlines()) <= 200
    targets = re.findall(r"\]\((?!https?://)([^)#]+)(?:#[^)]*)?\)", README)
    assert targets, "the README links its documentation"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """CI (`.ci/run`) must run the README's test command, and the main command must be the
    README's too: the two commands stay true."""
    commands = indented_commands()
    test_cmd = next(c.split("#")[0].strip() for c in commands if "pytest" in c)
    main_cmd = next(c.split("#")[0].strip() for c in commands if "quickstart.py" in c)
    assert test_cmd in (ROOT / ".ci" / "run").read_text()
    assert (ROOT / "examples" / "quickstart.py").exists() and main_cmd.startswith("./scripts/setup.sh &&")


@pytest.fixture(scope="module")
def readme_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A fresh cache directory for the README's code (its agents and checkpoints start
    empty), sharing the converted models of the session's own so nothing is converted again."""
    cache = tmp_path_factory.mktemp("readme-cache")
    models = Settings().cache_dir / "models"
    if models.is_dir():
        (cache / "models").symlink_to(models, target_is_directory=True)
    env = {**os.environ, "AGENT_MEMORY_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    env.pop("AGENT_MEMORY_MODEL", None)
    yield env


def run_block(code: str, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"README block failed:\n{code}\n--- stderr:\n{done.stderr[-3000:]}"
    return done.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_readme_python_blocks_run_as_pasted(
    readme_env: dict[str, str], tmp_path: Path, figures: dict[str, str]
) -> None:
    """Each ```python block of the README, as pasted, in a new process; the one that talks to
    the server runs against a server started with the README's own `agent-memory serve` line."""
    blocks = python_blocks()
    assert len(blocks) >= 3, "hello world, the graph and the server's client"
    outcomes: list[str] = []
    for code in blocks:
        if f"127.0.0.1:{README_PORT}" in code:
            out = run_against_readme_server(code, tmp_path, readme_env)
        else:
            out = run_block(code, tmp_path, readme_env)
        assert out.strip(), f"the block printed nothing:\n{code}"
        outcomes.append(out)
    hello, graph, served = outcomes[0], outcomes[1], outcomes[2]
    # the hello world says what it promises: a cold first turn, then the cache extended
    lines = hello.strip().splitlines()
    assert lines[0].split()[0] == "cold" and lines[1].split()[0] == "hot-extend", hello
    # a second process: the agent comes back from disk
    again = run_block(python_blocks()[0], tmp_path, readme_env)
    assert again.split()[0].startswith("warm-"), again
    # the writer's second turn extends its first (the critic's diverges: its question to the
    # model is not in the graph's state)
    assert graph.strip().splitlines()[1].startswith("['hot-extend'"), graph
    # the server's client sends the whole conversation: its second turn extends the first
    # (it sent the new question alone, a hot-diverge without context)
    assert re.findall(r"^(cold|(?:hot|warm)-[a-z]+)\b", served, flags=re.M)[:2] == ["cold", "hot-extend"], (
        served
    )
    figures["README blocks run as pasted"] = f"{len(blocks)} of {len(blocks)}"


def run_against_readme_server(code: str, cwd: Path, env: dict[str, str]) -> str:
    serve = next(c.split("#")[0].strip() for c in indented_commands() if c.startswith("agent-memory serve"))
    port = str(free_port())
    argv = serve.replace(README_PORT, port).split()
    argv[0] = str(BIN / argv[0])
    server = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.3)
        return run_block(code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}"), cwd, env)
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_docs_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """`mkdocs build --strict`: every page in the nav, every link and snippet resolves, and
    the API reference renders from the docstrings."""
    mkdocs = shutil.which("mkdocs", path=str(BIN))
    assert mkdocs, "mkdocs is missing: install the [docs] extra (scripts/setup.sh --dev does)"
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "ChatAgentMemory" in api and "AgentMemorySaver" in api and "max_tokens" in api
    outcomes = (tmp_path / "site" / "concepts" / "outcomes" / "index.html").read_text()
    assert "hot-extend" in outcomes  # the README's glossary, included
    assert "loaded_from" in outcomes and "disk, prefetched" in outcomes
    # the README's figure, on the home page too (served from benchmarks/results/)
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'src="figures/gpu.png"' in home
    assert (tmp_path / "site" / "figures" / "gpu.png").read_bytes() == (
        ROOT / "benchmarks/results/gpu.png"
    ).read_bytes()
    assert (tmp_path / "site" / "guides" / "troubleshooting" / "index.html").exists()


def test_the_package_builds_and_passes_twine_check(tmp_path: Path) -> None:
    """What publishing needs: a wheel and an sdist ``twine check`` accepts, the licence file
    inside, and LangChain's agents (``create_agent``) in the main install, not an extra (the
    guide's agent failed with ``No module named 'langchain'`` after the main set-up)."""
    import zipfile

    built = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    dists = sorted(tmp_path.iterdir(), key=lambda p: p.suffix)
    assert [p.suffix for p in dists] == [".gz", ".whl"]
    checked = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, dists)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    with zipfile.ZipFile(dists[1]) as wheel:
        info = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = wheel.read(info).decode()
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in wheel.namelist())
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist: ")]
    assert "Requires-Dist: langchain>=1.0" in requires  # no ``extra ==`` marker: the main install
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Typing :: Typed" in metadata


@pytest.mark.slow
def test_the_api_reference_examples_run_as_pasted(readme_env: dict[str, str], tmp_path: Path) -> None:
    """The API reference had 38 code blocks, all signatures: each entry now starts with an
    example (the error a model is refused with excepted: it names a command), and each runs
    as pasted, in a new process, and says what its comments promise."""
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    entries = re.split(r"^::: .*$", page, flags=re.M)[:-1]  # the text before each entry
    names = re.findall(r"^::: (.*)$", page, flags=re.M)
    bare = [n for n, text in zip(names, entries, strict=True) if "```python" not in text]
    assert bare == ["langchain_agent_memory.engine.model.structure.UnsupportedModelError"], bare
    outputs = [
        run_block(code, tmp_path, readme_env) for code in re.findall(r"```python\n(.*?)```", page, flags=re.S)
    ]
    chat, graph, overflow, engine = outputs[:4]
    assert chat.split() == ["cold", "hot-extend"], chat
    assert graph.split() == ["cold", "hot-extend"], graph
    assert overflow.startswith("too long: the prompt is"), overflow
    assert engine.split()[:2] == ["cold", "hot-extend"], engine
