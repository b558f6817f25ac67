"""The kernels that read a batch's host fields (attention: grid and key splits; conv: form, token blocks, overlap)
give a one-row prefill graph's batch the same results as the row's own eager batch. The graph's batch has the row
plus a padding row on the dummies (empty when the row fills the size), and host fields bounded by the size alone:
2 rows, `size` query tokens, max_model_len keys. Padding rows and placeholder splits change only summation order
(fp32 here: 1e-5); the row's carried state and page footers must be written exactly as the eager step writes
them, and nothing else the row owns may be touched.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.batch import PageTables, ScheduledChunk, build_forward_batch
from hybridserve.runtime.prefill_graphs import PrefillGraphs
from tests.ops.conftest import DEVICE

PAGE = 4
MAX_MODEL_LEN = 64
# (prefix, tokens, size): rows that fill their size (an empty padding row), a fresh row padded, a row resuming a
# state after 11 cached tokens (starting mid-page), rows padded past the conv's columns-form bound (16 tokens) into
# its heads form, or within either form. The interpreter runs the conv's columns form slowly: fewer cases there.
CASES = [(0, 16, 16), (0, 9, 16), (11, 5, 16), (3, 13, 32), (0, 32, 32), (6, 40, 64)]
CONV_CASES = [(11, 5, 16), (3, 13, 32), (0, 32, 32), (6, 40, 64)]


def _row(prefix: int, tokens: int, gen: torch.Generator) -> ScheduledChunk:
    pages = (torch.randperm(MAX_MODEL_LEN // PAGE, generator=gen)[:-(-(prefix + tokens) // PAGE)] + 1).tolist()
    return ScheduledChunk([0] * tokens, prefix, pages, 1, prefix > 0, [tokens - 1], table_row=0)


def _graph_batch(chunk: ScheduledChunk, size: int):
    tables = PageTables(2, MAX_MODEL_LEN // PAGE + 1, DEVICE)
    tables.upload_updates([chunk])
    graphs = PrefillGraphs(None, tables, PAGE, MAX_MODEL_LEN, [size], DEVICE, capture=False, placeholders=True)
    graphs._fill(chunk, size)
    return graphs._batch(size)


@pytest.mark.parametrize("prefix, tokens, size", CASES)
def test_attention_on_a_prefill_graph_batch(prefix: int, tokens: int, size: int) -> None:
    from hybridserve.ops.triton.attention import paged_attention

    gen = torch.Generator().manual_seed(prefix + tokens)
    chunk = _row(prefix, tokens, gen)
    rows = (MAX_MODEL_LEN // PAGE + 1) * PAGE
    k, v = (torch.randn(rows, 2, 32, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(size, 8, 32, generator=gen).to(DEVICE)
    graph = _graph_batch(chunk, size)
    assert graph.num_seqs == 2 and graph.max_query_len == size and graph.max_kv_len == MAX_MODEL_LEN
    want = paged_attention(q[:tokens], k, v, build_forward_batch([chunk], PAGE, DEVICE), 0.2)
    got = paged_attention(q, k, v, graph, 0.2)
    torch.testing.assert_close(got[:tokens], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()  # the padding row too (it reads the dummy page)


@pytest.mark.parametrize("prefix, tokens, size", CONV_CASES)
def test_conv_on_a_prefill_graph_batch(prefix: int, tokens: int, size: int) -> None:
    from hybridserve.ops.triton.conv import cca_conv

    gen = torch.Generator().manual_seed(prefix + tokens)
    chunk = _row(prefix, tokens, gen)
    q_heads, k_heads, d, history = 4, 2, 16, 2
    channels, lag_width = (q_heads + k_heads) * d, k_heads * d // 2
    proj = torch.randn(size, channels + 2 * lag_width, generator=gen)
    weights = [torch.randn(channels, 1, 2, generator=gen), torch.randn(channels, generator=gen) * 0.1,
               torch.randn(channels, d, 2, generator=gen) / d ** 0.5, torch.randn(channels, generator=gen) * 0.1,
               torch.randn(lag_width, generator=gen) * 0.1]
    pages = MAX_MODEL_LEN // PAGE + 1
    caches = [torch.randn(3, channels, history, generator=gen), torch.randn(3, lag_width, generator=gen),
              torch.full((pages, channels, history), -7.0), torch.full((pages, lag_width), -7.0)]
    outputs = {}
    for name, batch, rows in (("eager", build_forward_batch([chunk], PAGE, DEVICE), tokens),
                              ("graph", _graph_batch(chunk, size), size)):
        state = [c.clone().to(DEVICE) for c in caches]
        out = cca_conv(proj[:rows].to(DEVICE), *[w.to(DEVICE) for w in weights[:4]], weights[4].to(DEVICE),
                       q_heads, 0, batch, *state)
        outputs[name] = [t[:tokens] for t in out], state
    (want, want_state), (got, got_state) = outputs["eager"], outputs["graph"]
    for a, b in zip(got[:2], want[:2]):  # q, k: computed
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])  # the value: a copy of its input
    # The row's slot (1) and its pages' footers as the eager step writes them (copies of inputs: exactly); slot 2
    # and unused pages untouched. The padding row writes only the dummies: slot 0 and page 0's footer.
    owned = [1, 2], list(range(1, pages))
    for a, b, index in zip(got_state, want_state, (owned[0], owned[0], owned[1], owned[1])):
        assert torch.equal(a[index], b[index])
