"""FP8 quantization without a model: the quantization_config forms and their errors, the torch references against
float64 formulations written from the definitions, QuantizedTensor's slicing, and every layer kind loading FP8
weights under simulated tensor parallelism (each rank's dequantized shard = the shard of the dequantized whole)."""
from __future__ import annotations

import pytest
import torch

from hybridserve.core.parallel import set_tensor_parallel_group
from hybridserve.core.quant import (
    FP8_DTYPE,
    Fp8Scheme,
    QuantizedTensor,
    QuantScope,
    dequantize,
    parse_quantization,
)
from hybridserve.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from hybridserve.layers.moe import StackedExperts
from hybridserve.layers.weights import fp8_scales
from hybridserve.ops.reference.fp8 import (
    fp8_fused_experts,
    fp8_linear,
    quantize_activations,
    quantize_weight,
    quantize_weight_rows,
)
from tests.models.fp8_fixtures import quantization_config

ROWS, BLOCK = Fp8Scheme("channel", "token"), Fp8Scheme("block", "group", (128, 128))
STATIC = Fp8Scheme("channel", "static")
E4M3 = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
GRID = E4M3[torch.isfinite(E4M3)].unique()  # every finite e4m3 value, sorted


# ------------------------------------------------------------------------------------------------ config forms


@pytest.mark.parametrize("layout, weight, activation", [("channel", "channel", "token"), ("tensor", "tensor", "token"),
                                                         ("static", "channel", "static"), ("block", "block", "group")])
def test_the_checkpoint_forms(layout, weight, activation):
    quant = parse_quantization({"quantization_config": quantization_config(layout, ["lm_head", "re:.*mlp\\.gate$"])},
                               None)
    assert (quant.scheme.weight, quant.scheme.activation, quant.scheme.online) == (weight, activation, False)
    assert quant.scale_name("x.weight") == ("x.weight_scale_inv" if layout == "block" else "x.weight_scale")
    scope = QuantScope(quant).child("model.layers.3")
    assert scope.scheme("mlp.gate") is None and scope.scheme("mlp.gate_proj") == quant.scheme
    assert scope.scheme("attention.query_key_value", "attention.g_proj") == quant.scheme
    assert QuantScope(quant).scheme("lm_head") is None
    assert QuantScope(quant).child("model").scheme("lm_head") == quant.scheme  # exact names, not suffixes


def test_online_and_none():
    assert parse_quantization({}, None) is None
    assert QuantScope().scheme("anything") is None
    online = parse_quantization({}, "fp8").scheme
    assert (online.weight, online.activation, online.online) == ("channel", "token", True)


@pytest.mark.parametrize("edit, message", [
    (lambda q: q.update(quant_method="awq"), "quant_method='awq'"),
    (lambda q: q.update(format="pack-quantized"), "format='pack-quantized'"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=4), "weights.num_bits=4"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="group"), "weights.strategy='group'"),
    (lambda q: q["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"), "input_activations"),
    (lambda q: q["config_groups"]["group_0"].update(targets=["Attention"]), "targets=\\['Attention'\\]"),
    (lambda q: q.update(kv_cache_scheme={"num_bits": 8}), "kv_cache_scheme"),
])
def test_unsupported_compressed_tensors_fields_are_named(edit, message):
    config = quantization_config("channel", [])
    edit(config)
    with pytest.raises(ValueError, match=message):
        parse_quantization({"quantization_config": config}, None)


def test_unsupported_block_fp8_and_option_errors():
    for key, value in (("weight_block_size", [64, 64]), ("activation_scheme", "static"), ("fmt", "e5m2")):
        config = quantization_config("block", []) | {key: value}
        with pytest.raises(ValueError, match=f"{key}="):
            parse_quantization({"quantization_config": config}, None)
    with pytest.raises(ValueError, match="quantization='int8'"):
        parse_quantization({}, "int8")
    with pytest.raises(ValueError, match="already quantized"):
        parse_quantization({"quantization_config": quantization_config("block", [])}, "fp8")


# ------------------------------------------------------------------------------------------------ references


def _nearest_on_grid(values: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether every e4m3 value in `q` is a nearest grid point to the exact value (ties either way)."""
    v = values.double().clamp(-448, 448).flatten()
    distance = (GRID.double()[None, :] - v[:, None]).abs().min(1).values
    return bool(((q.double().flatten() - v).abs() <= distance + 1e-12).all())


@pytest.mark.parametrize("scheme", [ROWS, BLOCK, STATIC])
def test_quantize_activations_is_amax_over_448_then_nearest(scheme):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen) * torch.logspace(-3, 2, 5)[:, None]  # rows of very different sizes
    x[2] = 0.0  # an all-zero row: zeros, not NaN
    q, scale = quantize_activations(x, scheme, torch.tensor(0.05))
    assert q.dtype == FP8_DTYPE
    if scheme.activation == "token":
        assert torch.equal(scale, (x.abs().amax(-1) / 448).clamp_min(1e-12))
        unscaled = x / scale[:, None]
    elif scheme.activation == "group":
        groups = [x[:, i:i + 128] for i in range(0, 300, 128)]
        assert torch.equal(scale, torch.stack([(g.abs().amax(-1) / 448).clamp_min(1e-12) for g in groups], 1))
        unscaled = torch.cat([g / scale[:, i, None] for i, g in enumerate(groups)], 1)
    else:
        assert torch.equal(scale, torch.tensor(0.05))
        unscaled = x / 0.05
    assert _nearest_on_grid(unscaled, q.float())
    assert torch.isfinite(q.float()).all() and not q[2].float().any()


@pytest.mark.parametrize("scheme", [ROWS, BLOCK])
def test_quantize_weight_scales_and_rounding(scheme):
    w = torch.randn(260, 300, generator=torch.Generator().manual_seed(1))
    q, scale = quantize_weight(w, scheme)
    full = dequantize(q, scale, scheme)
    expanded = full / q.float().where(q.float() != 0, torch.ones(()))  # the scale each element got
    if scheme.weight == "block":
        assert scale.shape == (3, 3)
        assert torch.allclose(scale[2, 2], w[256:, 256:].abs().max() / 448)
        assert torch.allclose(expanded[255, 299], scale[1, 2]) and torch.allclose(expanded[256, 0], scale[2, 0])
    else:
        assert torch.equal(scale, w.abs().amax(-1) / 448)
        assert torch.equal(quantize_weight_rows(w)[0].float(), q.float())
    per_element = expanded if scheme.weight == "block" else scale[:, None]
    assert _nearest_on_grid(w / per_element, q.float())


def _linear64(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme, input_scale=None,
              weight_only: bool = False):
    """fp8_linear from its definition, in float64: per K block, (x values . w values) x the two scales (x as it
    is, with a unit scale, when `weight_only`)."""
    if weight_only:
        scheme = Fp8Scheme(scheme.weight, "static", scheme.block)
        q, xs = x, torch.tensor(1.0)
    else:
        q, xs = quantize_activations(x, scheme, input_scale)
    qx, qw = q.double(), w.double()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for k0 in range(0, x.shape[1], 128):
        part = qx[:, k0:k0 + 128] @ qw[:, k0:k0 + 128].T
        if scheme.activation == "group":
            part = part * xs[:, k0 // 128, None].double()
        if scheme.weight == "block":
            part = part * scale[:, k0 // 128].double().repeat_interleave(128)[:w.shape[0]][None, :]
        out += part
    if scheme.activation == "token":
        out *= xs[:, None].double()
    if scheme.activation == "static":
        out *= float(xs)
    if scheme.weight != "block":
        out *= scale[None, :].double()
    return out


@pytest.mark.parametrize("weight_only", [False, True], ids=["W8A8", "weight-only"])
@pytest.mark.parametrize("scheme", [ROWS, BLOCK, STATIC])
def test_fp8_linear_against_its_definition(scheme, weight_only):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 300, generator=gen), torch.randn(260, 300, generator=gen) * 0.05
    bias = torch.randn(260, generator=gen)
    q, scale = quantize_weight(w, scheme)
    got = fp8_linear(x, q, scale, scheme, bias, torch.tensor(0.01), weight_only)
    want = _linear64(x, q, scale, scheme, torch.tensor(0.01), weight_only) + bias.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert fp8_linear(x.half(), q, scale, scheme, None, torch.tensor(0.01)).dtype == torch.float16


@pytest.mark.parametrize("weight_only", [False, True], ids=["W8A8", "weight-only"])
@pytest.mark.parametrize("scheme", [ROWS, BLOCK])
def test_fp8_experts_against_a_loop_over_choices(scheme, weight_only):
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, inter, experts = 6, 256, 160, 4
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = [quantize_weight(torch.randn(2 * inter, hidden, generator=gen) * 0.1, scheme) for _ in range(experts)]
    w2 = [quantize_weight(torch.randn(hidden, inter, generator=gen) * 0.1, scheme) for _ in range(experts)]
    ids = torch.tensor([[0, 2], [2, 2], [1, 3], [3, 0], [0, 1], [2, 3]])
    weights = torch.rand(tokens, 2, generator=gen)
    weights[1, 1] = 0.0  # a zero-weight choice adds exactly nothing
    got = fp8_fused_experts(x, torch.stack([q for q, _ in w13]), torch.stack([s for _, s in w13]),
                            torch.stack([q for q, _ in w2]), torch.stack([s for _, s in w2]), ids, weights, scheme,
                            weight_only=weight_only)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(2):
            e = int(ids[t, k])
            gate, up = _linear64(x[t:t + 1], *w13[e], scheme, weight_only=weight_only).chunk(2, dim=-1)
            h = (torch.nn.functional.silu(gate) * up).float()
            want[t] += weights[t, k].double() * _linear64(h, *w2[e], scheme, weight_only=weight_only)[0]
    assert torch.allclose(got.double(), want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------------ slicing


def test_quantized_tensor_normalises_and_slices_its_scales():
    gen = torch.Generator().manual_seed(4)
    q, s = quantize_weight_rows(torch.randn(3, 256, 64, generator=gen))
    per_tensor = QuantizedTensor(q[0], torch.tensor([0.5]), ROWS)
    assert per_tensor.scale.shape == (256,) and bool((per_tensor.scale == 0.5).all())
    stack = QuantizedTensor(q, s[..., None], ROWS)  # compressed-tensors' [N, 1] per expert
    assert stack.scale.shape == (3, 256) and torch.equal(stack[1].scale, s[1])
    rows = stack.narrow(-2, 128, 128)
    assert torch.equal(rows.dequantize(torch.float32), dequantize(q, s, ROWS)[:, 128:])
    assert [p.shape for p in stack[0].split([100, 156])] == [torch.Size([100, 64]), torch.Size([156, 64])]
    blocks = QuantizedTensor(*quantize_weight(torch.randn(300, 256, generator=gen), BLOCK), BLOCK)
    assert torch.equal(blocks.narrow(0, 128, 172).dequantize(torch.float32), blocks.dequantize(torch.float32)[128:])
    assert torch.equal(blocks.narrow(1, 0, 128).scale, blocks.scale[:, :1])
    with pytest.raises(ValueError, match="128-element boundaries"):
        blocks.narrow(0, 0, 150)
    with pytest.raises(ValueError, match="expected \\(3, 2\\)"):
        QuantizedTensor(blocks.data, torch.ones(2, 2), BLOCK)
    with pytest.raises(ValueError, match="neither one per row"):
        QuantizedTensor(q[0], torch.ones(7), ROWS)


# ------------------------------------------------------------------------------------------------ layers under TP


@pytest.fixture
def tp_group():
    yield lambda rank: set_tensor_parallel_group(rank, 2, None)
    set_tensor_parallel_group(0, 1, None)


def _quantized(shape: tuple[int, ...], scheme: Fp8Scheme, seed: int) -> QuantizedTensor:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    pieces = [quantize_weight(m, scheme) for m in (w if w.dim() == 3 else [w])]
    q, s = (torch.stack(t) for t in zip(*pieces)) if w.dim() == 3 else pieces[0]
    return QuantizedTensor(q, s, scheme)


def _dequantized(param: torch.nn.Parameter) -> torch.Tensor:
    fp8 = fp8_scales(param)
    return dequantize(param.data, fp8.scale.data, fp8.scheme)


@pytest.mark.parametrize("scheme", [ROWS, BLOCK], ids=["rows", "blocks"])
@pytest.mark.parametrize("rank", [0, 1])
def test_layers_load_fp8_shards(tp_group, rank, scheme):
    tp_group(rank)
    column, row = ColumnParallelLinear(256, 512, quant=scheme), RowParallelLinear(512, 256, quant=scheme)
    merged = MergedColumnParallelLinear(256, [512, 256, 128], replicated=[False, False, True], quant=scheme)
    experts = StackedExperts(3, 256, 256, split_gate_up=True, quant=scheme)
    full = {"column": _quantized((512, 256), scheme, 0), "row": _quantized((256, 512), scheme, 1),
            "merged": [_quantized((n, 256), scheme, 2 + i) for i, n in enumerate((512, 256, 128))],
            "gate": _quantized((3, 256, 256), scheme, 5), "up": _quantized((3, 256, 256), scheme, 6),
            "down": _quantized((3, 256, 256), scheme, 7)}
    column.weight.weight_loader(column.weight, full["column"], None)
    row.weight.weight_loader(row.weight, full["row"], None)
    for i, piece in enumerate(full["merged"]):
        merged.weight.weight_loader(merged.weight, piece, i)
    for e in range(3):
        for half, name in enumerate(("gate", "up")):
            experts.gate_up_proj.weight_loader(experts.gate_up_proj, full[name][e], (e, half))
        experts.down_proj.weight_loader(experts.down_proj, full["down"][e], e)

    def whole(t: QuantizedTensor) -> torch.Tensor:
        return t.dequantize(torch.float32)

    half = slice(rank * 128, (rank + 1) * 128)
    assert torch.equal(_dequantized(column.weight), whole(full["column"])[rank * 256:(rank + 1) * 256])
    assert torch.equal(_dequantized(row.weight), whole(full["row"])[:, rank * 256:(rank + 1) * 256])
    a, b, c = (whole(p) for p in full["merged"])
    assert torch.equal(_dequantized(merged.weight), torch.cat([a[rank * 256:(rank + 1) * 256], b[half], c]))
    assert torch.equal(_dequantized(experts.gate_up_proj), torch.cat([whole(full["gate"])[:, half],
                                                                      whole(full["up"])[:, half]], 1))
    assert torch.equal(_dequantized(experts.down_proj), whole(full["down"])[:, :, half])


def test_block_shards_must_fall_on_block_edges(tp_group):
    tp_group(1)
    layer = ColumnParallelLinear(256, 320, quant=BLOCK)  # 160 rows a rank: not a multiple of 128
    with pytest.raises(ValueError, match="128-element boundaries"):
        layer.weight.weight_loader(layer.weight, _quantized((320, 256), BLOCK, 0), None)


def test_static_input_scale_is_the_largest_of_the_pieces():
    layer = MergedColumnParallelLinear(128, [128, 128], quant=STATIC)
    for i, scale in enumerate((0.02, 0.03)):
        q, s = quantize_weight_rows(torch.randn(128, 128))
        layer.weight.weight_loader(layer.weight, QuantizedTensor(q, s, STATIC, torch.tensor([scale])), i)
    assert float(layer.weight_input_scale) == pytest.approx(0.03)
    with pytest.raises(ValueError, match="input_scale"):
        layer.weight.weight_loader(layer.weight, QuantizedTensor(q, s, STATIC), 0)
