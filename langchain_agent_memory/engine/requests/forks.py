"""Prefixes shared by requests in flight: a fan-out (eight LangGraph ``Send`` tasks, an
``llm.batch``) sends several agents prompts that start alike (the same system prompt and
document), at the same moment, before any of them has stored a block. Without sharing each
would prefill the common part itself; here the later ones wait until the first has run it,
then start from copies of its layer caches up to where their prompts part
(copy-on-write: stored parts are shared views, only the working copies are their own).

The forked keys and values are the ones the request would have computed (the same tokens at
the same positions), so its output is the same as alone at 16-bit KV; a source that had
reused stored (quantized) blocks passes those on, as a shared-block start would.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..kv import LayerCache, RecurrentCache
from ..prefix import NOT_A_BOUNDARY, TokenizedText

#: Fewest tokens worth waiting for and forking (below this, prefilling them is as cheap).
MIN_SHARED_TOKENS = 128
#: Fewest tokens worth forking from a source that runs no more than that to hold them: a
#: fan-out's prompts run on past the stored blocks (the rest of the shared system prompt,
#: the template's turn header), which each sibling prefilled again (8 Sends over 1K stored
#: tokens of SmolLM2: 20 of their 35 new tokens each).
MIN_FORK_TOKENS = 16


def worth_forking(saved: int, wait: int) -> bool:
    """Whether to fork a source whose first tokens save ``saved`` of a request's prefill,
    once the source has run ``wait`` more of its own: a long prefix whatever the wait, a
    short one where the source runs no more than the fork saves."""
    return saved >= MIN_SHARED_TOKENS or (saved >= MIN_FORK_TOKENS and wait <= saved)


def clean_cut(tokens: TokenizedText, n: int, step: int = 1) -> int:
    """The largest ``m <= n``, a multiple of ``step``, after which ``tokens`` can be cut (not
    inside a character). A hybrid model forks at block boundaries (``step`` 256): the only
    points where a source in mid-prefill holds its recurrent state (``ModelRunner.prefill``)."""
    n -= n % step
    while n > 0 and tokens.ends[n - 1] == NOT_A_BOUNDARY:
        n -= step
    return max(n, 0)


def can_fork(layers: Sequence[LayerCache], n_tokens: int) -> bool:
    """Whether ``layers`` hold what a request keeping their first ``n_tokens`` needs: every
    full layer from position 0, every sliding layer its last window before ``n_tokens``,
    every recurrent layer its state at ``n_tokens``."""
    for layer in layers:
        if isinstance(layer, RecurrentCache):
            if layer.state_at(n_tokens) is None:
                return False
            continue
        if layer.offset < n_tokens:
            return False
        window = layer.spec.window
        if layer.start > (0 if window is None else max(0, n_tokens - window)):
            return False
    return True


def fork_layers(source: Sequence[LayerCache], fresh: Sequence[LayerCache], n_tokens: int) -> None:
    """Load ``fresh`` (empty caches of the same model) with ``source``'s first ``n_tokens``
    (``can_fork`` first): stored parts as views (mlx copies a buffer rather than write into
    one a view still reads), the source request's own full-precision tokens as the fork's
    pending ones (committed with the fork's)."""
    for src, dst in zip(source, fresh, strict=True):
        if isinstance(src, RecurrentCache):
            dst.load(n_tokens, src.state_at(n_tokens))  # type: ignore[call-arg]
            continue
        stored_end = min(n_tokens, src.committed_end)
        head, body = src.committed_slice(src.start, stored_end)
        dst.load(src.start, head, *(body or (None, None)))
        if stored_end == src.committed_end and src.work.shared is not None:
            dst.work.share(src.work.shared)  # the same stored part: decoded once for both
        if n_tokens > src.committed_end:
            pk, pv = src.pending_k, src.pending_v
            assert pk is not None and pv is not None
            n = n_tokens - src.committed_end
            dst.push_pending(pk[:, :, :n], pv[:, :, :n])
        if dst.offset != n_tokens:
            raise RuntimeError(f"a fork holds {dst.offset} tokens, not {n_tokens} (this is a bug)")
