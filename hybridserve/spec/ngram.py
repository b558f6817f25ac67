"""Prompt-lookup (n-gram) drafts: propose what followed the latest earlier occurrence of the context's suffix.

For n from `n_max` down to `n_min`, the last n tokens of prompt + output are looked up among all earlier windows of
n tokens; at the first n that occurs, the tokens that followed its latest occurrence (up to `k`) are the drafts.
Nothing to train or load, and it pays off where outputs repeat their context: code edits, RAG, agents' tool calls.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens continuing `tokens` (none when no suffix n-gram of length n_min..n_max recurs)."""
    if k < 1 or len(tokens) <= n_min:
        return []
    context = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        # Windows starting before the suffix itself, so that at least one token follows each of them.
        windows = sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return context[start:start + k].tolist()
    return []
