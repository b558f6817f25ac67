"""Batched sampling from fp32 logits: logit bias, penalties, temperature, top-k, top-p, min-p, greedy, and logprobs.

Each draw uses one uniform number derived on the host from (request seed, token index) with splitmix64, and
inverts the CDF of the filtered distribution (`ops.sampling`). The draw for a request therefore never depends on
what else is in the batch or on the device, and needs no per-request generator objects.
"""
from __future__ import annotations

import torch

from hybridserve.core.step import SampledToken, SamplingRow
from hybridserve.core.upload import device_scalar, upload
from hybridserve.ops.sampling import draw_sorted, draw_unsorted
from hybridserve.structured.bitmask import TokenMask, apply_token_mask

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on the request's seed and the token index."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ step) >> 11) / float(1 << 53)


def _pack(logprobs: torch.Tensor, chosen: torch.Tensor, k: int, listed: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, 2 + 2k (+ listed width)] float64 on the device: each row's chosen token, its logprob, its top-k (ids,
    logprobs) and the logprobs of the ids in `listed` ([rows, width] long: the rows' logprob_token_ids, padded;
    the host knows the ids). Ids travel as float64 (exact for any vocabulary), so that one device-to-host copy
    carries them all."""
    columns = [chosen[:, None].double(), logprobs.gather(-1, chosen[:, None]).double()]
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        columns += [ids.double(), values.double()]
    if listed is not None:
        columns.append(logprobs.gather(-1, listed).double())
    return torch.cat(columns, dim=1)


def _unpack(host: list[list[float]], k: int) -> tuple[list[int], list[float], list[list], list[list[float]]]:
    """_pack's columns on the host: chosen tokens, their logprobs, the top-k (id, logprob) and the listed logprobs."""
    return ([int(r[0]) for r in host], [r[1] for r in host],
            [list(zip(map(int, r[2:2 + k]), r[2 + k:2 + 2 * k])) for r in host], [r[2 + 2 * k:] for r in host])


def _listed_index(rows: list[SamplingRow], device: torch.device) -> torch.Tensor | None:
    """The rows' logprob_token_ids as one [rows, widest] index on the device (shorter rows padded with token 0,
    whose logprobs the host drops), in one queued copy; None when no row lists any. Its shape comes from the
    host's parameters, never from device values."""
    width = max(len(r.params.logprob_token_ids) for r in rows)
    if not width:
        return None
    ids = [r.params.logprob_token_ids + [0] * (width - len(r.params.logprob_token_ids)) for r in rows]
    return upload(ids, device, torch.long)


def logprob_dicts(logprobs: torch.Tensor, chosen: list[int], k: int) -> list[dict[int, float]]:
    """Per row {token: logprob} for the chosen token and the row's top-k (the chosen one included)."""
    packed = _pack(logprobs, torch.tensor(chosen, device=logprobs.device), k)
    _, chosen_lp, tops, _ = _unpack(packed.tolist(), k)
    return [dict(top) | {token: lp} for token, lp, top in zip(chosen, chosen_lp, tops)]


class Draws:
    """One sampler call's tokens, still on the device (`tokens`, which the next step may read as its inputs), and
    what comes back to the host: the tokens alone, or packed with the logprobs the rows asked for. `start_copy`
    queues the one device-to-host copy (pinned, asynchronous on CUDA); `result` waits for it."""

    def __init__(self, tokens: torch.Tensor, rows: list[SamplingRow], packed: torch.Tensor | None, top_k: int):
        self.tokens, self._rows, self._top_k = tokens, rows, top_k
        self._device_out = packed if packed is not None else tokens
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    @classmethod
    def placeholder(cls, rows: int, device: torch.device) -> Draws:
        """Token 0 for `rows` rows whose draw failed (the engine aborts their request and discards them)."""
        return cls(torch.zeros(rows, dtype=torch.long, device=device), [], None, 0)

    def start_copy(self) -> None:
        out = self._device_out
        if out.device.type != "cuda":
            self._host = out
            return
        self._host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        self._host.copy_(out, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def result(self) -> list[SampledToken]:
        if self._host is None:
            self.start_copy()
        if self._copied is not None:
            self._copied.synchronize()
        if self._device_out is self.tokens:
            return [SampledToken(t) for t in self._host.tolist()]
        token_list, chosen_lp, tops, listed = _unpack(self._host.tolist(), self._top_k)
        out = [SampledToken(t) for t in token_list]
        for i, row in enumerate(self._rows):
            if row.params.logprobs is not None:
                out[i].logprob = chosen_lp[i]
                out[i].top_logprobs = tops[i][: row.params.logprobs] + list(zip(row.params.logprob_token_ids,
                                                                                 listed[i]))
        return out


# Rows sampled together: bounds the [rows, vocab] temporaries (sorted copies, float64 blocks) of one call.
_MAX_ELEMENTS_PER_CALL = 1 << 25


def penalty_rows(max_running: int) -> int:
    """Rows of penalty counts for `max_running` running sequences: two per place. A step takes rows for its new
    sequences before the rows of the sequences that drew in the step before (and not in this one) are given back,
    so two steps' sequences can hold rows at once; with that many every penalised sequence always has its row,
    whose counts then include its previous token even while that token is still on its way to the host."""
    return 2 * max_running


class PenaltyCounts:
    """Each penalised sequence's output-token counts and prompt-token flags on the device, kept across its draws:
    each drawn token is counted on the device as it is drawn (`record`), and a draw adds from the host lists only
    tokens not counted yet (rebuilding them from the whole token lists every step made long generations
    quadratic). Rows live in [capacity, vocab] tensors allocated on first use (5 bytes per vocabulary entry and
    row); a sequence without a draw in a step (finished, preempted) gives its
    row back at `end_step` and is rebuilt from its lists if it draws again."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.counts: torch.Tensor | None = None  # [capacity, vocab] fp32
        self.seen: torch.Tensor | None = None  # [capacity, vocab] bool: prompt tokens
        self._rows: dict[int, list[int]] = {}  # key -> [row, output tokens counted]
        self._drawn: set[int] = set()

    def rows(self, rows: list[SamplingRow], vocab: int, device: torch.device) -> list[int | None]:
        """The state row of each sampling row, brought up to date (None: no key, or no room; compute afresh)."""
        if self.counts is None or self.counts.shape[1] != vocab or self.counts.device != device:
            self.counts = torch.zeros(self.capacity, vocab, device=device)
            self.seen = torch.zeros(self.capacity, vocab, dtype=torch.bool, device=device)
            self._rows.clear()
        free = sorted(set(range(self.capacity)) - {r for r, _ in self._rows.values()}, reverse=True)
        out, add_rows, add_tokens, flag_rows, flag_tokens, cleared = [], [], [], [], [], []
        for row in rows:
            entry = self._rows.get(row.key) if row.key is not None else None
            if entry is None and row.key is not None and free:
                if row.index != len(row.output_token_ids) + len(row.draft_prefix or ()):
                    raise RuntimeError("a sequence with a token in flight has no penalty counts to hold it")
                entry = self._rows[row.key] = [free.pop(), 0]
                cleared.append(entry[0])
                flag_rows += [entry[0]] * len(row.prompt_token_ids)
                flag_tokens += row.prompt_token_ids
            if entry is None:
                out.append(None)
                continue
            new = row.output_token_ids[entry[1]:]  # empty while the last drawn token is still in flight
            add_rows += [entry[0]] * len(new)
            add_tokens += new
            entry[1] = max(entry[1], len(row.output_token_ids))
            self._drawn.add(row.key)
            out.append(entry[0])
        if cleared:
            index = upload(cleared, device, torch.long)
            self.counts.index_fill_(0, index, 0.0)
            self.seen.index_fill_(0, index, False)
        if flag_rows:
            self.seen.index_put_(tuple(upload([flag_rows, flag_tokens], device, torch.long)),
                                 device_scalar(True, device, torch.bool))
        if add_rows:
            self.counts.index_put_(tuple(upload([add_rows, add_tokens], device, torch.long)),
                                   device_scalar(1.0, device, self.counts.dtype), accumulate=True)
        return out

    def record(self, counted: list[tuple[int, int]], tokens: torch.Tensor) -> None:
        """Count the tokens just drawn (batch row -> state row) on the device, before the host sees them: the
        next step may draw before they are appended to the sequence's list (overlapped scheduling)."""
        batch_rows, state_rows = zip(*counted)
        device = tokens.device
        self.counts.index_put_((upload(list(state_rows), device, torch.long),
                                tokens.index_select(0, upload(list(batch_rows), device, torch.long))),
                               device_scalar(1.0, device, self.counts.dtype), accumulate=True)
        counted_rows = set(state_rows)
        for entry in self._rows.values():
            if entry[0] in counted_rows:
                entry[1] += 1

    def end_step(self) -> None:
        """Free the rows of sequences that drew nothing since the previous call."""
        for key in [k for k in self._rows if k not in self._drawn]:
            del self._rows[key]
        self._drawn.clear()


def _apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logit_bias added to its logits, on the device (the biases travel in one queued copy: no
    synchronisation with the forward still running)."""
    biased = [(i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias.items()]
    if not biased:
        return logits
    row_ids, token_ids, biases = zip(*biased)
    index = tuple(upload([list(row_ids), list(token_ids)], logits.device, torch.long))
    return logits.index_put(index, upload(list(biases), logits.device, logits.dtype), accumulate=True)


def _restrict_to_allowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows with allowed_token_ids keep only those tokens' logits (the others -inf); other rows keep all."""
    allowed = [(i, token) for i, r in enumerate(rows) for token in r.params.allowed_token_ids]
    if not allowed:
        return logits
    device = logits.device
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.index_put_(tuple(upload(list(zip(*allowed)), device, torch.long)), device_scalar(True, device, torch.bool))
    free = [i for i, r in enumerate(rows) if not r.params.allowed_token_ids]
    if free:
        keep.index_fill_(0, upload(free, device, torch.long), True)
    return logits.masked_fill(~keep, float("-inf"))


class Sampler:
    def __init__(self, max_running: int = 128):
        self.penalties = PenaltyCounts(penalty_rows(max_running))

    def end_step(self) -> None:
        self.penalties.end_step()

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """Draw and wait for the tokens on the host."""
        return [token for draws in self.draw(logits, rows) for token in draws.result()]

    def draw(self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None = None) -> list[Draws]:
        """Queue one token per row on the device (rows in groups that bound the [rows, vocab] temporaries). The
        penalty counts take the drawn tokens only once every group is drawn: a call that fails part-way (the
        caller then retries request by request) counts nothing. `mask` (on the logits' device): the allowed
        tokens of the rows with a grammar."""
        step = max(1, _MAX_ELEMENTS_PER_CALL // logits.shape[-1])
        groups = [self._draw_rows(logits[start:start + step], rows[start:start + step],
                                  mask.restrict(start, start + step) if mask is not None else None)
                  for start in range(0, len(rows), step)]
        for draws, counted in groups:
            if counted:
                self.penalties.record(counted, draws.tokens)
        return [draws for draws, _ in groups]

    def _draw_rows(self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMask | None
                   ) -> tuple[Draws, list[tuple[int, int]]]:
        """The rows' draws and (batch row, penalty-state row) of those whose counts must take the drawn token.
        Logprobs are the raw model's; the grammar mask, the logit bias and allowed_token_ids apply before penalties
        and sampling."""
        device = logits.device
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        if mask is not None:
            logits = apply_token_mask(logits, mask)
        logits = _restrict_to_allowed(_apply_logit_bias(logits, rows), rows)
        logits, counted = self._apply_penalties(logits, rows)
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        if banned:
            logits = logits.index_put(tuple(upload(list(zip(*banned)), device, torch.long)),
                                      device_scalar(float("-inf"), device, logits.dtype))
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(drawn) == len(rows):
            tokens = self._sample(logits, rows)
        else:
            tokens = logits.argmax(dim=-1)
            if drawn:
                index = upload(drawn, device, torch.long)
                tokens = tokens.index_copy(0, index, self._sample(logits[index], [rows[i] for i in drawn]))
        forced = [(i, r.forced_token) for i, r in enumerate(rows) if r.forced_token is not None]
        if forced:
            index, values = upload(list(zip(*forced)), device, torch.long)
            tokens = tokens.index_copy(0, index, values)
        if raw_logprobs is None:
            return Draws(tokens, rows, None, 0), counted
        top_k = max(r.params.logprobs or 0 for r in rows)
        return Draws(tokens, rows, _pack(raw_logprobs, tokens, top_k, _listed_index(rows, device)), top_k), counted

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]
                         ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """The penalised logits, and (batch row, state row) of the rows whose counts must take the drawn token."""
        idx = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not idx:
            return logits, []
        device = logits.device
        penalised = upload(idx, device, torch.long)  # indexing by a host list would copy it synchronously
        sub = logits.index_select(0, penalised)
        state = self.penalties.rows([rows[i] for i in idx], logits.shape[-1], device)
        kept = [j for j, s in enumerate(state) if s is not None]
        counts = torch.zeros_like(sub)
        seen = torch.zeros_like(sub, dtype=torch.bool)
        if kept:
            index, state_index = upload(kept, device, torch.long), upload([state[j] for j in kept], device,
                                                                             torch.long)
            counts[index] = self.penalties.counts[state_index]
            seen[index] = self.penalties.seen[state_index]
        for j, i in enumerate(idx):  # rows without kept state (forks' first draws, tests): from their lists
            if state[j] is None:
                if rows[i].index != len(rows[i].output_token_ids) + len(rows[i].draft_prefix or ()):
                    raise RuntimeError("a penalised draw with a token still in flight needs its kept counts")
                out_ids = upload(rows[i].output_token_ids, device, torch.long)
                counts[j].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
                seen[j].index_fill_(0, upload(rows[i].prompt_token_ids, device, torch.long), True)
        drafted = [(j, t) for j, i in enumerate(idx) for t in rows[i].draft_prefix or ()]
        if drafted:  # verify positions: the drafts before them count as output
            counts.index_put_(tuple(upload(list(zip(*drafted)), device, torch.long)),
                              device_scalar(1.0, device, counts.dtype), accumulate=True)
        seen |= counts > 0

        def column(name: str) -> torch.Tensor:
            return upload([getattr(rows[i].params, name) for i in idx], device, torch.float32)[:, None]

        rep = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
        counted = [(idx[j], state[j]) for j in kept if rows[idx[j]].draft_prefix is None]
        return logits.index_copy(0, penalised, sub), counted

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row (every row samples), by inverting the CDF of each row's filtered distribution at the
        row's own uniform number (`ops.sampling`). Only rows with top-k or top-p need the vocabulary sorted; the
        others invert the CDF in vocabulary order. Which path a row takes depends on its own parameters only, so a
        draw never depends on the rest of the batch."""
        vocab = logits.shape[-1]
        params = upload([[r.params.temperature, r.params.top_k if 0 < r.params.top_k < vocab else vocab,
                           r.params.top_p, r.params.min_p, uniform_for(r.seed, r.index)]
                          for r in rows], logits.device)
        needs_sort = [0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows]
        if not any(needs_sort):
            return draw_unsorted(logits, params)
        if all(needs_sort):
            return draw_sorted(logits, params)
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        for wanted, draw in ((True, draw_sorted), (False, draw_unsorted)):
            index = upload([i for i, s in enumerate(needs_sort) if s == wanted], logits.device, torch.long)
            picks[index] = draw(logits[index], params[index])
        return picks
