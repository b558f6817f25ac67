"""The torch references of the Ling lightning-layer fusions compute what the unfused modules computed (so fusing
changes no result on the CPU path), and the fused Q|K|V|G projection loads each rank's heads under TP."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridserve.core.parallel import set_tensor_parallel_group
from hybridserve.layers.norm import RMSNorm
from hybridserve.layers.rotary import RotaryEmbedding
from hybridserve.models.ling_config import parse_ling_config
from hybridserve.ops.reference.ling_norm import (
    add_rms_norm,
    group_rms_norm,
    qk_norm_rope,
    rms_norm,
)
from hybridserve.ops.reference.norm import rms_normalize
from hybridserve.runtime.build_model import build_model
from tests.reference.ling_naive import (
    group_rms_norm as naive_group_rms_norm,
)
from tests.reference.ling_naive import (
    random_ling_checkpoint,
    tiny_ling_config,
    write_checkpoint,
)

EPS = 1e-6


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_equals_add_then_norm(dtype: torch.dtype) -> None:
    """Bit for bit, in the model dtype: the residual stream keeps the numerics of `h = (x + a) + r; RMSNorm(h)`,
    with RMSNorm the unfused module's formula (normalise in fp32, round to the stream's dtype, times the weight)."""
    x, addend, residual = (torch.randn(6, 40, generator=_gen(s)).to(dtype) for s in (0, 3, 1))
    norm = RMSNorm(40, EPS, dtype=dtype)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(40, generator=_gen(2)))

    def unfused(h: torch.Tensor) -> torch.Tensor:
        return norm.weight * rms_normalize(h, EPS).to(dtype)

    out, new_residual, out32 = add_rms_norm(x, residual, norm.weight, EPS)
    assert torch.equal(new_residual, x + residual) and out32 is None
    assert torch.equal(out, unfused(x + residual))
    assert torch.equal(rms_norm(x, norm.weight, EPS), unfused(x))
    out, new_residual, out32 = add_rms_norm(x, residual, norm.weight, EPS, addend=addend, fp32_copy=True)
    assert torch.equal(new_residual, (x + addend) + residual)
    assert torch.equal(out, unfused((x + addend) + residual))
    assert out32.dtype == torch.float32 and torch.equal(out32, out.float())
    parts = torch.stack([x, addend, residual], dim=1)  # [T, 3, C]: summed first, rounded once
    assert all(torch.equal(a, b) for a, b in zip(add_rms_norm(parts, residual, norm.weight, EPS)[:2],
                                                 add_rms_norm(parts.sum(1), residual, norm.weight, EPS)[:2]))
    # The module's forms go through the op entries.
    assert torch.equal(norm(x), unfused(x))
    fused = norm(x, residual, addend, fp32_copy=True)
    assert all(torch.equal(a, b) for a, b in zip(fused, (out, new_residual, out32), strict=True))


def test_gated_group_rms_norm_is_norm_then_gate() -> None:
    """Lightning's output GroupRMSNorm and sigmoid gate (norm first, gate second) from the naive reference's
    per-group formula, fp32 x, bf16 weight and gate: exactly one rounding, at the end."""
    x = torch.randn(5, 24, generator=_gen(3))
    x[:, :8] *= 10.0
    weight = (1 + 0.1 * torch.randn(24, generator=_gen(4))).bfloat16()
    gate = torch.randn(5, 24, generator=_gen(5)).bfloat16()
    expected = (naive_group_rms_norm(x, weight.float(), 3, EPS) * torch.sigmoid(gate.float())).bfloat16()
    got = group_rms_norm(x, weight, 3, EPS, gate)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected.float()).abs().max().item() <= 2 ** -8 * expected.float().abs().max().item()


def test_qk_norm_rope_equals_norms_then_rotary() -> None:
    """fp32: the RMSNorm modules then RotaryEmbedding (NeoX, partial) give the same q and k."""
    heads, d = 3, 16
    qk = 3 * torch.randn(7, 2, heads, d, generator=_gen(6))
    q_norm, k_norm = RMSNorm(d, EPS), RMSNorm(d, EPS)
    q_norm.weight.data.copy_(1 + 0.2 * torch.randn(d, generator=_gen(7)))
    k_norm.weight.data.copy_(1 + 0.2 * torch.randn(d, generator=_gen(8)))
    rotary = RotaryEmbedding(8, 6e6)
    positions = torch.tensor([0, 1, 5, 64, 100, 2000, 70000])
    expected = torch.stack([rotary(positions, q_norm(qk[:, 0])), rotary(positions, k_norm(qk[:, 1]))], dim=1)
    got = qk_norm_rope(qk, q_norm.weight, k_norm.weight, positions, rotary.inv_freq, EPS)
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


@pytest.mark.parametrize("rank", [0, 1])
def test_fused_qkvg_projection_loads_each_ranks_heads(tmp_path: Path, rank: int) -> None:
    """TP=2: a rank's Q|K|V|G weight is [its Q heads | its K heads | its V heads | its g_proj rows], from the
    checkpoint's query_key_value [3w, D] and g_proj [w, D] tensors (names unchanged)."""
    config = tiny_ling_config()
    tensors = random_ling_checkpoint(config, seed=9)
    write_checkpoint(tmp_path, config, tensors)
    set_tensor_parallel_group(rank, 2, None)
    try:
        model, _ = build_model(tmp_path, torch.float32, torch.device("cpu"))
    finally:
        set_tensor_parallel_group(0, 1, None)
    width = parse_ling_config(config).num_heads * config["head_dim"]
    local = slice(rank * width // 2, (rank + 1) * width // 2)
    for layer in (0, 2):  # the lightning layers of the tiny config
        prefix = f"model.layers.{layer}.attention."
        q, k, v = tensors[prefix + "query_key_value.weight"].split(width)
        expected = torch.cat([q[local], k[local], v[local], tensors[prefix + "g_proj.weight"][local]])
        assert torch.equal(model.model.layers[layer].attention.query_key_value.weight, expected)
