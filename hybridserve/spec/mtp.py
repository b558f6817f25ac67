"""NEXTN drafting with the model's multi-token-prediction layer (Ling-2.6's MTP; spec §6): a chain of top-1 drafts.

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

Entry p depends on token p + 1, which a prefix-cache hit ending at p + 1 does not fix: the entry at a hit's last
cached position is the inserting request's (only its drafts can suffer, never the output).
"""
from __future__ import annotations

import dataclasses

import torch

from hybridserve.core.batch import ForwardBatch, HostPack, ScheduledChunk


class MtpDrafter:
    def __init__(self, model, num_drafts: int, page_size: int):
        self.model, self.k, self.page_size = model, num_drafts, page_size

    def draft(self, batch: ForwardBatch, hidden: torch.Tensor, chunks: list[ScheduledChunk],
              first_draws: list[int | None], drawn: torch.Tensor | None,
              accepted: torch.Tensor | None) -> torch.Tensor | None:
        """Drafts [R, k] on the device for the R chunks that drew (`first_draws[i]`: chunk i's first draw in
        `drawn`, None if it drew nothing; None when none drew: the extension alone); `accepted` [verify rows]: the
        verify rows' accepted counts (plan order)."""
        pack = HostPack()
        known_rows, known_tokens, drawn_rows, drawn_index = [], [], [], []
        base, rows, reach, verify_base = [], [], [], []
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
        for name, values in (("known_rows", known_rows), ("known_tokens", known_tokens), ("drawn_rows", drawn_rows),
                             ("drawn_index", drawn_index), ("base", base), ("rows", rows), ("reach", reach),
                             ("verify_base", verify_base)):
            pack.add(name, values)
        t = pack.upload(hidden.device)
        ids = torch.empty_like(batch.input_ids)
        ids[:-1] = batch.input_ids[1:]
        ids[-1] = 0  # a row end: set below (or a chunk whose next token is unknown: its entry is never read)
        ids[t["known_rows"]] = t["known_tokens"]
        if not rows:  # the extension alone: the layer's KV of these positions
            self.model.draft_hidden(ids, hidden, batch)
            return None
        ids[t["drawn_rows"]] = drawn[t["drawn_index"]]
        if accepted is not None:  # a verify row drafts from its last accepted position
            t["base"].index_add_(0, t["verify_base"], accepted)
        out = self.model.draft_hidden(ids, hidden, batch)[t["base"]]
        drafts = [self.model.compute_logits(out).argmax(dim=-1)]
        chain = self._chain_batch(batch, t["rows"], batch.positions[t["base"]], t["reach"],
                                  max(p + len(c.token_ids) for p, c in zip(batch.prefix_lens, chunks)) + self.k)
        for j in range(1, self.k):
            step = chain(j)
            out = self.model.draft_hidden(drafts[-1], out, step)
            drafts.append(self.model.compute_logits(out).argmax(dim=-1))
        return torch.stack(drafts, dim=1)

    def _chain_batch(self, batch: ForwardBatch, rows: torch.Tensor, base: torch.Tensor, reach: torch.Tensor,
                     max_kv_len: int):
        """step j -> the one-token-per-row batch at positions base + j (KV rows from the rows' page tables; past a
        row's reserved pages, the dummy page 0)."""
        size = rows.shape[0]
        page_table = batch.page_table.index_select(0, rows)
        index = torch.arange(size, device=rows.device)
        dummy = torch.zeros(0, dtype=torch.long, device=rows.device)

        def step(j: int) -> ForwardBatch:
            positions = base + j
            page = page_table.gather(1, (positions // self.page_size).clamp(max=page_table.shape[1] - 1)[:, None])
            slots = torch.where(positions < reach, page[:, 0] * self.page_size, 0) + positions % self.page_size
            return dataclasses.replace(
                batch, query_lens=[1] * size, query_starts=list(range(size)), prefix_lens=[max_kv_len - 1] * size,
                is_decode=True, max_query_len=1, max_kv_len=max_kv_len, input_ids=dummy, positions=positions,
                query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=rows.device),
                seq_ids=index.to(torch.int32), kv_lens=positions + 1, page_table=page_table, slot_mapping=slots,
                state_slots=batch.state_slots.index_select(0, rows),
                has_initial_state=batch.has_initial_state.index_select(0, rows), logits_indices=index,
                page_end_tokens=dummy, page_end_pages=dummy, token_history=None, verify=None,
                window_page_table=None, window_slot_mapping=None)

        return step
