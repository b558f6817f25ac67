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
_MAX_ELEMENTS_PER_CALL = 1 << 24


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
            row_idx, tok_idx = zip(*banned)
            logits = logits.index_put((torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)),
                                      torch.tensor(float("-inf"), device=device))
        tokens = logits.argmax(dim=-1)
        if not all(r.params.greedy for r in rows):
            sampled = self._sample(logits, rows)
            greedy = torch.tensor([r.params.greedy for r in rows], device=device)
            tokens = torch.where(greedy, tokens, sampled)
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
        device, vocab = logits.device, logits.shape[-1]
        # Greedy rows (temperature below 1e-5) are sampled too but take the argmax; divide them by 1.
        temperature = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows],
                                   device=device)[:, None]
        probs = torch.softmax(logits / temperature, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        top_k = torch.tensor([r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows], device=device)
        sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        top_p = torch.tensor([r.params.top_p for r in rows], device=device)[:, None]
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill((mass_before > top_p) & (rank > 0), 0.0)
        min_p = torch.tensor([r.params.min_p for r in rows], device=device)[:, None]
        sorted_probs = sorted_probs.masked_fill(sorted_probs < min_p * sorted_probs[:, :1], 0.0)
        cdf = sorted_probs.double().cumsum(dim=-1)
        u = torch.tensor([uniform_for(r.seed, len(r.output_token_ids)) for r in rows], device=device,
                         dtype=torch.float64)[:, None] * cdf[:, -1:]
        pick = torch.searchsorted(cdf, u, right=True).clamp(max=vocab - 1)
        # Never land on a zeroed (filtered) entry through rounding at the top of the CDF.
        pick = torch.minimum(pick, (sorted_probs > 0).sum(dim=-1, keepdim=True) - 1)
        return order.gather(-1, pick).squeeze(-1)
