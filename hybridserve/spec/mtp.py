"""NEXTN drafting with the model's multi-token-prediction layer (Ling-2.6's MTP): a chain of top-1 drafts.

The MTP layer at position p reads the embedding of token p + 1 and the target's final hidden state at p, and
predicts token p + 2. It keeps its own KV: one MLA layer in the same paged pool, sharing the sequence's pages, and
no recurrent state. After a step's draws (and the verify rows' commit) it runs on the device, without a sync:

1. Extend: over every row of the step, each position with its next token: the next input token inside the row,
   the next prompt token after a prompt chunk (`ScheduledChunk.next_token_id`), the drawn token at the end of a
   drawing row. A verify row reads the draw at each of its positions: below the accepted count that is the
   accepted draft, at it the bonus (or correcting) token; positions past it hold the rejected drafts' entries,
   which later steps overwrite. So every committed position's entry is written from true tokens and the target's
   hidden states, as the step that commits it runs.
2. Draft: at each drawing row's last committed position b (a verify row's: its start + accepted count) the
   extension's logits give draft 1; drafts 2..k chain: the layer runs one token per row at b + j - 1 on the
   previous draft and its own output there (its KV written at b + j - 1, in pages the scheduler reserved ahead,
   `Speculation.lookahead`; past them, on the dummy page). Every draft is the argmax: q is one-hot.

`inputs` prepares a step's index tensors on the host (one upload); `run` is pure device work on them, so CUDA-graph
verify steps (runtime/cuda_graphs.py) replay it from static copies of the same inputs.

Entry p depends on token p + 1, which a prefix-cache hit ending at p + 1 does not fix: the entry at a hit's last
cached position is the inserting request's (only its drafts can suffer, never the output).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hybridserve.core.batch import ForwardBatch, HostPack
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.models.base import DraftModel


@dataclass
class DraftInputs:
    ids: torch.Tensor  # [T] each position's next token
    base: torch.Tensor  # [R] packed index of each drafting row's last committed position
    rows: torch.Tensor  # [R] the drafting rows' batch rows
    reach: torch.Tensor  # [R] positions each drafting row's pages cover (its chain writes past them go to page 0)
    page_table: torch.Tensor  # [R, W] their rows of the persistent page table (wide enough for every chain)
    max_kv_len: int  # a bound on the chain's key counts (attention grids)


class MtpDrafter:
    def __init__(self, model: DraftModel, num_drafts: int, page_size: int):
        self.model, self.k, self.page_size = model, num_drafts, page_size

    def inputs(self, batch: ForwardBatch, chunks: list[ScheduledChunk], first_draws: list[int | None],
               drawn: torch.Tensor | None, accepted: torch.Tensor | None, pages: torch.Tensor) -> DraftInputs:
        """The draft inputs of an eager step: chunk i's first draw in `drawn` is `first_draws[i]` (None: it drew
        nothing); `accepted` [verify rows]: the verify rows' accepted counts (plan order); `pages`: the persistent
        page table (`PageTables.full.pages`). R = the drawing rows."""
        pack = HostPack()
        known_rows, known_tokens, drawn_rows, drawn_index = [], [], [], []
        base, rows, reach, verify_base, table_rows = [], [], [], [], []
        for row, (chunk, start, first) in enumerate(zip(chunks, batch.query_starts, first_draws)):
            last = start + len(chunk.token_ids) - 1
            if first is None:
                if chunk.next_token_id is not None:
                    known_rows.append(last)
                    known_tokens.append(chunk.next_token_id)
                continue
            span = 1 + chunk.num_drafts
            drawn_rows += range(last - span + 1, last + 1)
            drawn_index += range(first, first + span)
            if chunk.num_drafts:
                verify_base.append(len(base))
            base.append(start if chunk.num_drafts else last)
            rows.append(row)
            reach.append(len(chunk.page_ids) * self.page_size)
            table_rows.append(chunk.table_row)
        for name, values in (("known_rows", known_rows), ("known_tokens", known_tokens), ("drawn_rows", drawn_rows),
                             ("drawn_index", drawn_index), ("base", base), ("rows", rows), ("reach", reach),
                             ("verify_base", verify_base), ("table_rows", table_rows)):
            pack.add(name, values)
        t = pack.upload(batch.input_ids.device)
        # Each position's next token; a row's end is set below (or, in a chunk whose next token is unknown, never
        # read). Not `ids[-1] = 0`: a host scalar stored into a device tensor waits for the stream.
        ids = torch.cat((batch.input_ids[1:], batch.input_ids.new_zeros(1)))
        ids[t["known_rows"]] = t["known_tokens"]
        if drawn_rows:
            ids[t["drawn_rows"]] = drawn[t["drawn_index"]]
        if accepted is not None:  # a verify row drafts from its last accepted position
            t["base"].index_add_(0, t["verify_base"], accepted)
        return DraftInputs(ids, t["base"], t["rows"], t["reach"], pages.index_select(0, t["table_rows"]),
                           max(p + len(c.token_ids) for p, c in zip(batch.prefix_lens, chunks)) + self.k)

    def run(self, batch: ForwardBatch, hidden: torch.Tensor, inputs: DraftInputs) -> torch.Tensor | None:
        """Extend over the batch, then draft: [R, k] on the device (None without drafting rows: the extension
        alone, which writes the layer's KV of these positions)."""
        out = self.model.draft_hidden(inputs.ids, hidden, batch)
        if inputs.rows.numel() == 0:
            return None
        out = out[inputs.base]
        drafts = [self.model.compute_logits(out).argmax(dim=-1)]
        chain = self._chain_batch(batch, inputs)
        for j in range(1, self.k):
            out = self.model.draft_hidden(drafts[-1], out, chain(j))
            drafts.append(self.model.compute_logits(out).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def _chain_batch(self, batch: ForwardBatch, inputs: DraftInputs):
        """step j -> the one-token-per-row batch at positions base + j (KV rows from the rows' page tables; past a
        row's reserved pages, the dummy page 0)."""
        rows, size, page_table = inputs.rows, inputs.rows.shape[0], inputs.page_table
        base = batch.positions[inputs.base]
        index = torch.arange(size, device=rows.device)
        query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=rows.device)
        dummy = torch.zeros(0, dtype=torch.long, device=rows.device)

        def step(j: int) -> ForwardBatch:
            positions = base + j
            page = page_table.gather(1, (positions // self.page_size).clamp(max=page_table.shape[1] - 1)[:, None])
            slots = torch.where(positions < inputs.reach, page[:, 0] * self.page_size, 0) + positions % self.page_size
            return dataclasses.replace(
                batch, query_lens=[1] * size, query_starts=list(range(size)),
                prefix_lens=[inputs.max_kv_len - 1] * size, is_decode=True, max_query_len=1,
                max_kv_len=inputs.max_kv_len, input_ids=dummy, positions=positions, query_start_loc=query_start_loc,
                seq_ids=query_start_loc[:size], kv_lens=positions + 1, page_table=page_table, slot_mapping=slots,
                state_slots=batch.state_slots.index_select(0, rows),
                has_initial_state=batch.has_initial_state.index_select(0, rows), logits_indices=index,
                page_end_tokens=dummy, page_end_pages=dummy, token_history=None, verify=None,
                window_page_table=None, window_slot_mapping=None)

        return step
