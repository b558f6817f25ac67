"""Batched sampling from fp32 logits: penalties, temperature, top-k, top-p, min-p, greedy, and logprobs.

Each draw uses one uniform number derived on the host from (request seed, token index) with splitmix64, and
inverts the CDF of the filtered distribution. The draw for a request therefore never depends on what else is in
the batch or on the device, and needs no per-request generator objects.
"""
from __future__ import annotations

import torch

from hybridserve.core.step import SampledToken, SamplingRow

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, step: int) -> float:
    """A uniform number in [0, 1) that depends only on the request's seed and the token index."""
    return (splitmix64(splitmix64(seed & _MASK64) ^ step) >> 11) / float(1 << 53)


def top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[list[float], list[list]]:
    """Logprob of each row's chosen token and its top-k (token, logprob) pairs, as host lists."""
    chosen_lp = logprobs.gather(-1, chosen[:, None]).squeeze(-1).tolist()
    if k == 0:
        return chosen_lp, [[] for _ in chosen_lp]
    values, ids = logprobs.topk(k, dim=-1)
    return chosen_lp, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def logprob_dicts(logprobs: torch.Tensor, chosen: list[int], k: int) -> list[dict[int, float]]:
    """Per row {token: logprob} for the chosen token and the row's top-k (the chosen one included)."""
    chosen_lp, tops = top_logprobs(logprobs, torch.tensor(chosen, device=logprobs.device), k)
    return [dict(top) | {token: lp} for token, lp, top in zip(chosen, chosen_lp, tops)]


# Rows sampled together: bounds the [rows, vocab] temporaries (sorted copies, a float64 CDF) of one call.
_MAX_ELEMENTS_PER_CALL = 1 << 25


def _upload(values: list, device: torch.device, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Host values -> a device tensor in one copy (pinned and asynchronous on CUDA, no sync)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        step = max(1, _MAX_ELEMENTS_PER_CALL // logits.shape[-1])
        return [token for start in range(0, len(rows), step)
                for token in self._sample_rows(logits[start:start + step], rows[start:start + step])]

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        device = logits.device
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in rows) else None
        logits = self._apply_penalties(logits, rows)
        banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        if banned:
            logits = logits.index_put(tuple(_upload(list(zip(*banned)), device, torch.long)),
                                      torch.tensor(float("-inf"), device=device))
        drawn = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(drawn) == len(rows):
            tokens = self._sample(logits, rows)
        else:
            tokens = logits.argmax(dim=-1)
            if drawn:
                index = _upload(drawn, device, torch.long)
                tokens = tokens.index_copy(0, index, self._sample(logits[index], [rows[i] for i in drawn]))
        token_list = tokens.tolist()
        out = [SampledToken(t) for t in token_list]
        if raw_logprobs is not None:
            k = max(r.params.logprobs or 0 for r in rows)
            chosen_lp, tops = top_logprobs(raw_logprobs, tokens, k)
            for i, row in enumerate(rows):
                if row.params.logprobs is not None:
                    out[i].logprob = chosen_lp[i]
                    out[i].top_logprobs = tops[i][: row.params.logprobs]
        return out

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        idx = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not idx:
            return logits
        logits = logits.clone()
        device = logits.device
        sub = logits[idx]
        counts = torch.zeros_like(sub)
        seen = torch.zeros_like(sub, dtype=torch.bool)
        for j, i in enumerate(idx):
            out_ids = torch.tensor(rows[i].output_token_ids, dtype=torch.long, device=device)
            counts[j].index_add_(0, out_ids, torch.ones_like(out_ids, dtype=counts.dtype))
            seen[j, torch.tensor(rows[i].prompt_token_ids, dtype=torch.long, device=device)] = True
        seen |= counts > 0

        def column(name: str) -> torch.Tensor:
            return torch.tensor([getattr(rows[i].params, name) for i in idx], device=device)[:, None]

        rep = column("repetition_penalty")
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
        logits[idx] = sub
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row (every row samples), by inverting the CDF of each row's filtered distribution at the
        row's own uniform number. Only rows with top-k or top-p need the vocabulary sorted; the others invert the
        CDF in vocabulary order. Which path a row takes depends on its own parameters only, so a draw never
        depends on the rest of the batch."""
        vocab = logits.shape[-1]
        params = _upload([[r.params.temperature, r.params.top_k if 0 < r.params.top_k < vocab else vocab,
                           r.params.top_p, r.params.min_p, uniform_for(r.seed, len(r.output_token_ids))]
                          for r in rows], logits.device)
        probs = torch.softmax(logits / params[:, :1].float(), dim=-1)
        needs_sort = [0 < r.params.top_k < vocab or r.params.top_p < 1.0 for r in rows]
        if not any(needs_sort):
            return _invert(probs, params)
        if all(needs_sort):
            return _sorted_draw(probs, params)
        picks = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        for wanted, draw in ((True, _sorted_draw), (False, _invert)):
            index = _upload([i for i, s in enumerate(needs_sort) if s == wanted], logits.device, torch.long)
            picks[index] = draw(probs[index], params[index])
        return picks


def _min_p_filter(probs: torch.Tensor, top: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    return probs.masked_fill(probs < min_p * top, 0.0)


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index where each row's CDF (float64) first exceeds u * total, never on a zeroed entry."""
    cdf = probs.double().cumsum(dim=-1)
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp(max=probs.shape[-1] - 1)
    # Rounding at the top of the CDF must not land past the last kept entry.
    last_kept = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
    return torch.minimum(pick, last_kept)


def _invert(probs: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Rows with neither top-k nor top-p: min-p against the row's top probability, then the CDF in vocab order."""
    probs = _min_p_filter(probs, probs.amax(dim=-1, keepdim=True), params[:, 3:4].float())
    return _pick(probs, params[:, 4:5]).squeeze(-1)


def _sorted_draw(probs: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Rows with top-k or top-p: top-k, renormalise, top-p (the smallest prefix holding top_p of the mass), min-p,
    then the CDF in descending-probability order."""
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(rank >= params[:, 1:2], 0.0)
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill((mass_before > params[:, 2:3]) & (rank > 0), 0.0)
    sorted_probs = _min_p_filter(sorted_probs, sorted_probs[:, :1], params[:, 3:4].float())
    return order.gather(-1, _pick(sorted_probs, params[:, 4:5])).squeeze(-1)
