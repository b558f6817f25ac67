"""The kernels that read a batch's host fields (attention: grid and key splits; conv: form, token blocks, overlap)
give a prefill graph's batch the same results as the step's own eager batch. The graph's batch has the step's rows,
the padding row on the dummies (empty when the rows fill the size), the unused row slots (empty) and host fields
bounded by the size alone: every row slot, `size` query tokens as if in the first row, max_model_len keys. Padding
and placeholder splits change only summation order (fp32 here: 1e-5); each row's carried state and page footers
must be written exactly as the eager step writes them, and nothing else a row owns may be touched.
"""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.batch import PageTables, ScheduledChunk, build_forward_batch
from hybridserve.runtime.prefill_graphs import PrefillGraphs
from tests.ops.conftest import DEVICE

PAGE = 4
MAX_MODEL_LEN = 64
SLOTS = 3  # row slots of the graphs: a step of fewer rows leaves empty ones
# Each case: the step's rows as (prefix, tokens), then the graph size. One row filling its size (an empty padding
# row), a fresh row padded, a row resuming a state after 11 cached tokens (starting mid-page), rows padded past
# the conv's columns-form bound (16 tokens) into its heads form; several rows: prompt chunks beside a decode row
# (one token after its prefix), all three slots full or one empty. The interpreter runs the conv's columns form
# slowly: fewer cases there.
CASES = [([(0, 16)], 16), ([(0, 9)], 16), ([(11, 5)], 16), ([(3, 13)], 32), ([(0, 32)], 32), ([(6, 40)], 64),
         ([(0, 9), (11, 1), (3, 4)], 16), ([(6, 20), (9, 1)], 32), ([(0, 12), (5, 1), (2, 19)], 32)]
CONV_CASES = [CASES[i] for i in (2, 3, 4, 5, 7, 8)]


def _rows(shape: list[tuple[int, int]], gen: torch.Generator) -> list[ScheduledChunk]:
    """The step's rows on disjoint pages; row i in table row i and state slot i + 1."""
    pages = (torch.randperm(MAX_MODEL_LEN // PAGE * SLOTS, generator=gen) + 1).tolist()
    rows = []
    for i, (prefix, tokens) in enumerate(shape):
        count = -(-(prefix + tokens) // PAGE)
        rows.append(ScheduledChunk([0] * tokens, prefix, pages[:count], i + 1, prefix > 0, [tokens - 1],
                                   table_row=i))
        pages = pages[count:]
    return rows


def _graph_batch(chunks: list[ScheduledChunk], size: int):
    tables = PageTables(SLOTS, MAX_MODEL_LEN // PAGE + 1, DEVICE)
    tables.upload_updates(chunks)
    graphs = PrefillGraphs(None, tables, PAGE, MAX_MODEL_LEN, [size], SLOTS, DEVICE, capture=False,
                           placeholders=True)
    graphs._fill(chunks, size)
    return graphs._batch(size)


def _name(case) -> str:
    return "-".join(f"{p}+{n}" for p, n in case[0]) + f"-in-{case[1]}"


@pytest.mark.parametrize("shape, size", CASES, ids=[_name(c) for c in CASES])
def test_attention_on_a_prefill_graph_batch(shape: list[tuple[int, int]], size: int) -> None:
    from hybridserve.ops.triton.attention import paged_attention

    gen = torch.Generator().manual_seed(size + len(shape))
    chunks = _rows(shape, gen)
    tokens = sum(n for _, n in shape)
    rows = (MAX_MODEL_LEN // PAGE * SLOTS + 1) * PAGE
    k, v = (torch.randn(rows, 2, 32, generator=gen).to(DEVICE) for _ in range(2))
    q = torch.randn(size, 8, 32, generator=gen).to(DEVICE)
    graph = _graph_batch(chunks, size)
    assert graph.num_seqs == SLOTS + 1 and graph.max_query_len == size and graph.max_kv_len == MAX_MODEL_LEN
    want = paged_attention(q[:tokens], k, v, build_forward_batch(chunks, PAGE, DEVICE), 0.2)
    got = paged_attention(q, k, v, graph, 0.2)
    torch.testing.assert_close(got[:tokens], want, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()  # the padding row too (it reads the dummy page)


@pytest.mark.parametrize("shape, size", CONV_CASES, ids=[_name(c) for c in CONV_CASES])
def test_conv_on_a_prefill_graph_batch(shape: list[tuple[int, int]], size: int) -> None:
    from hybridserve.ops.triton.conv import cca_conv

    gen = torch.Generator().manual_seed(size + len(shape))
    chunks = _rows(shape, gen)
    tokens = sum(n for _, n in shape)
    q_heads, k_heads, d, history = 4, 2, 16, 2
    channels, lag_width = (q_heads + k_heads) * d, k_heads * d // 2
    proj = torch.randn(size, channels + 2 * lag_width, generator=gen)
    weights = [torch.randn(channels, 1, 2, generator=gen), torch.randn(channels, generator=gen) * 0.1,
               torch.randn(channels, d, 2, generator=gen) / d ** 0.5, torch.randn(channels, generator=gen) * 0.1,
               torch.randn(lag_width, generator=gen) * 0.1]
    pages = MAX_MODEL_LEN // PAGE * SLOTS + 1
    slots = SLOTS + 2
    caches = [torch.randn(slots, channels, history, generator=gen), torch.randn(slots, lag_width, generator=gen),
              torch.full((pages, channels, history), -7.0), torch.full((pages, lag_width), -7.0)]
    outputs = {}
    for name, batch, rows in (("eager", build_forward_batch(chunks, PAGE, DEVICE), tokens),
                              ("graph", _graph_batch(chunks, size), size)):
        state = [c.clone().to(DEVICE) for c in caches]
        out = cca_conv(proj[:rows].to(DEVICE), *[w.to(DEVICE) for w in weights[:4]], weights[4].to(DEVICE),
                       q_heads, 0, batch, *state)
        outputs[name] = [t[:tokens] for t in out], state
    (want, want_state), (got, got_state) = outputs["eager"], outputs["graph"]
    for a, b in zip(got[:2], want[:2]):  # q, k: computed
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])  # the value: a copy of its input
    # Each row's slot and its pages' footers as the eager step writes them (copies of inputs: exactly); unused
    # slots and pages untouched. The padding row and empty row slots write only the dummies: slot 0 and page 0.
    owned = list(range(1, SLOTS + 2)), list(range(1, pages))
    for a, b, index in zip(got_state, want_state, (owned[0], owned[0], owned[1], owned[1])):
        assert torch.equal(a[index], b[index])
