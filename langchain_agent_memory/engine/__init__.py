"""The persistent KV engine (no LangChain imports).

NOTE: ``runtime`` first: it loads a fast BLAS into the process before anything imports
mlx (every module of the engine imports ``mx`` from it; importing this package makes the
order explicit whatever is imported first).
"""

from .ops import runtime  # noqa: F401
