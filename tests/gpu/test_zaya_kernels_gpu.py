"""ZAYA1 kernels on CUDA at ZAYA1-8B widths (hidden 2048, 8 q / 2 kv heads x 128, conv channels 1280, router 256,
16 experts), bf16 inputs against fp32 references on the same bf16-rounded inputs, and free of device-to-host syncs.

Bounds: the conv computes in fp32, but in its heads form the [128, 128] stage-2 product runs as a TF32 tl.dot (10-bit
mantissa), 3e-3 of the output scale; its columns form stays fp32, 1e-5 (tests/ops/test_conv_kernel.py). Its QKNorm/RoPE
epilogue rounds once to bf16 at the end: one bf16 ulp beyond the conv's bound. The norm rounds twice (normalised row,
then times the weight), against the fp32 result: two bf16 ulps. The router is fp32 end to end (its prefill GEMMs
3xTF32, as accurate): 1e-5, and choices equal wherever the reference has no near-tie.
"""
from __future__ import annotations

import pytest
import torch

from tests.gpu.sync import no_host_sync

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    from hybridserve.core.batch import ScheduledChunk, build_forward_batch
    from hybridserve.ops.reference import norm as norm_reference
    from hybridserve.ops.reference import zaya_router as router_reference
    from hybridserve.ops.qk_cache import QKCache
    from hybridserve.ops.triton import conv, norm, zaya_router
    from tests.ops.test_conv_kernel import run_conv_case
    from tests.ops.test_zaya_router_kernel import biased_probs, check_routing, router_inputs

HIDDEN, Q_HEADS, K_HEADS, HEAD_DIM, ROUTER, EXPERTS = 2048, 8, 2, 128, 256, 16
WIDTHS = dict(q_heads=Q_HEADS, k_heads=K_HEADS, d=HEAD_DIM)


@pytest.mark.parametrize("form", ["heads", "columns"])
@pytest.mark.parametrize("rows", [
    [(15, 1, True)],  # decode, B = 1, completing a page
    [(17 + 5 * i, 1, True) if i % 7 else (0, 1, False) for i in range(64)],  # decode, B = 64, fresh rows, pages
    [(3, 5, True), (15, 1, True), (0, 2, False)],  # a small mixed step (the columns form up to 64 tokens)
    [(0, 700, False), (31, 1, True), (16, 300, True), (0, 1, False), (47, 2, True)],  # mixed
], ids=["decode1", "decode64", "mixed8", "mixed"])
@pytest.mark.parametrize("epilogue", [False, True], ids=["conv", "qk-epilogue"])
def test_conv_at_zaya1_8b_widths(rows, form, epilogue):
    """The conv alone, and with its q/k epilogue (rotary dim 64 of 128) into a bf16 KV cache."""
    run_conv_case(rows, torch.bfloat16, form, page_size=16, rotary_dim=HEAD_DIM // 2 if epilogue else None,
                  **WIDTHS)


@pytest.mark.parametrize("rows", [1, 64])
def test_conv_columns_form_replays_from_a_cuda_graph(rows):
    """The columns form captured once and replayed over a decode step's state equals eager calls bit for bit (fp32
    sums in a fixed order, no float atomics): the arrival counters are back at zero after every replay, and the
    last program of each head writes the new window after the others have read the old one."""
    chunks = [ScheduledChunk([1], 15 + 4 * r, [r + 1] * (1 + (15 + 4 * r) // 16), r + 1, True, [0])
              for r in range(rows)]
    batch = build_forward_batch(chunks, 16, torch.device("cuda"), history_len=2)
    channels, lag = (Q_HEADS + K_HEADS) * HEAD_DIM, K_HEADS * HEAD_DIM // 2
    gen = torch.Generator(device="cuda").manual_seed(rows)
    bf16 = dict(device="cuda", dtype=torch.bfloat16)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, **bf16)

    proj = randn(rows, channels + 2 * lag)
    weights = (randn(channels, 1, 2), randn(channels), randn(channels, HEAD_DIM, 2) / HEAD_DIM ** 0.5,
               randn(channels))
    state = (randn(rows + 1, channels, 2), randn(rows + 1, lag))
    footers = (torch.zeros(4 * rows + 8, channels, 2, **bf16), torch.zeros(4 * rows + 8, lag, **bf16))
    args = (proj, *weights, weights[1][:lag], Q_HEADS, 0, batch, *state, *footers)
    conv.cca_conv(*args, form="columns")  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = conv.cca_conv(*args, form="columns")
    for _ in range(3):  # each replay advances the windows: a step's reads and writes in the right order
        before = [t.clone() for t in (*state, *footers)]
        proj.copy_(randn(rows, channels + 2 * lag))
        graph.replay()
        assert not conv._arrival_counters(proj.device).any()
        assert not torch.equal(state[0], before[0])  # the windows moved on (rows resumed: all of them)
        replayed = [t.clone() for t in (*captured, *state, *footers)]
        for t, old in zip((*state, *footers), before):
            t.copy_(old)
        eager = conv.cca_conv(*args, form="columns")
        for got, want in zip(replayed, (*eager, *state, *footers)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("tokens", [1, 256, 4096])
def test_residual_norm_at_zaya1_8b_widths(tokens):
    gen = torch.Generator().manual_seed(tokens)
    vectors = [(1 + 0.1 * torch.randn(HIDDEN, generator=gen)).bfloat16() for _ in range(5)]
    args = dict(update=(3 * torch.randn(tokens, HIDDEN, generator=gen)).bfloat16(),
                residual=10 * torch.randn(tokens, HIDDEN, generator=gen), update_bias=vectors[0] - 1,
                update_scale=vectors[1], residual_bias=vectors[2] - 1, residual_scale=vectors[3],
                skip_weight=torch.rand(tokens, 1, generator=gen), skip_input=torch.randn(tokens, HIDDEN, generator=gen)
                .bfloat16())
    want = norm_reference.residual_rms_norm(norm_weight=vectors[4].float(), eps=1e-5, **args)
    x, h, h32 = norm.residual_rms_norm(norm_weight=vectors[4].cuda(), eps=1e-5, fp32_copy=True,
                                       **{k: v.cuda() for k, v in args.items()})
    assert torch.allclose(x.cpu(), want[0], rtol=1e-6, atol=1e-5)
    ulp = torch.finfo(torch.bfloat16).eps
    assert ((h.cpu().float() - want[1]).abs() <= 2 * ulp * want[1].abs() + 1e-6).all()
    assert torch.equal(h32, h.float())


# Fused decode form up to 256 tokens; above, the 3xTF32 GEMM form in each of its tile shapes (gemm_tiles): 1e-5 holds
# only if 3xTF32 keeps fp32 accuracy at K = 2048.
@pytest.mark.parametrize("tokens", [1, 3, 17, 64, 256, 257, 1000, 3000, 8192])
def test_router_at_zaya1_8b_widths(tokens):
    args = router_inputs(tokens, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, device="cpu")
    want = router_reference.eda_route(**args)
    got = zaya_router.eda_route(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    check_routing(got, want, biased_probs(args, want.carry))


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("tokens", [1, 2])
def test_router_with_fc1_folded_at_zaya1_8b_widths(tokens, deferred):
    """The decode steps' router: the residual norm and fc1 (folded, `FoldedFc1`) in launch 1, two launches, the
    routing within 1e-5 of the reference's on the norm's output; deferred, its partial class logits sum to the
    logits of that routing's probabilities (their softmax)."""
    from hybridserve.ops.residual_norm_args import ResidualNormArgs
    args = router_inputs(tokens, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, seed=tokens, device="cpu")
    update = args.pop("x32").bfloat16()
    fold = router_reference.fold_fc1(args["down_weight"], args["down_bias"], args["states_scale"],
                                     args["norm_weight"], args["fc1_weight"])
    norm_weight = torch.ones(HIDDEN)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    (_, h), got = zaya_router.normed_route(update.cuda(), ResidualNormArgs(norm_weight.cuda(), 1e-5), **cuda,
                                           defer_selection=deferred,
                                           folded=router_reference.FoldedFc1(*(t.cuda() for t in fold)))
    want = router_reference.eda_route(h.float().cpu(), **args)
    if not deferred:
        check_routing(got, want, biased_probs(args, want.carry))
        return
    assert torch.allclose(got.carry.cpu(), want.carry, rtol=1e-5, atol=1e-5)
    probs = torch.softmax(got.selection.partials.sum(1)[:, :EXPERTS + 1].cpu(), dim=-1)
    assert torch.allclose(probs, biased_probs(args, want.carry) - args["balancing_biases"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_router_replays_from_a_cuda_graph(tokens):
    """The fused form captured once and replayed on new inputs equals eager calls bit for bit: the arrival counters
    are back at zero after every replay, and the last program of each token block sees every column of fc2."""
    static = {k: v.cuda() if isinstance(v, torch.Tensor) else v
              for k, v in router_inputs(tokens, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, device="cpu").items()}
    zaya_router.eda_route(**static)  # compiles (and allocates the counters) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = zaya_router.eda_route(**static)
    for seed in range(1, 4):
        fresh = router_inputs(tokens, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, seed=seed, device="cpu")
        for name in ("x32", "carry"):
            static[name].copy_(fresh[name])
        graph.replay()
        eager = zaya_router.eda_route(**static)
        for got, want in zip(captured.tensors(), eager.tensors(), strict=True):
            assert torch.equal(got, want)
        host = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in static.items()}
        want = router_reference.eda_route(**host)
        check_routing(captured, want, biased_probs(host, want.carry))


def test_kernels_issue_no_device_to_host_sync():
    """Decode-shaped calls of every ZAYA kernel under CUDA's sync debug mode (any sync raises)."""
    device = torch.device("cuda")
    rows = 8
    chunks = [ScheduledChunk([1], 15, [row + 1], row + 1, True, [0]) for row in range(rows)]
    batch = build_forward_batch(chunks, 16, device, history_len=2)
    channels, lag = (Q_HEADS + K_HEADS) * HEAD_DIM, K_HEADS * HEAD_DIM // 2
    bf16 = dict(device=device, dtype=torch.bfloat16)
    proj = torch.randn(rows, channels + 2 * lag, **bf16)
    weights = (torch.randn(channels, 1, 2, **bf16), torch.randn(channels, **bf16),
               torch.randn(channels, HEAD_DIM, 2, **bf16), torch.randn(channels, **bf16))
    state = (torch.zeros(rows + 1, channels, 2, **bf16), torch.zeros(rows + 1, lag, **bf16))
    footers = (torch.zeros(rows + 1, channels, 2, **bf16), torch.zeros(rows + 1, lag, **bf16))
    caches = [torch.zeros((rows + 1) * 16, K_HEADS, HEAD_DIM, **bf16) for _ in range(2)]
    inv_freq = torch.rand(HEAD_DIM // 4, device=device)
    residual = torch.randn(rows, HIDDEN, device=device)
    norm_weight = torch.ones(HIDDEN, **bf16)
    route = {k: v.cuda() if isinstance(v, torch.Tensor) else v
             for k, v in router_inputs(rows, HIDDEN, ROUTER, EXPERTS, skip_bias=0.05, device="cpu").items()}
    with no_host_sync():
        conv.cca_conv(proj, *weights, None, Q_HEADS, 0, batch, *state, *footers, form="heads")
        cache = QKCache(torch.ones(K_HEADS, **bf16), inv_freq, batch.slot_mapping, *caches, torch.bfloat16)
        q = conv.cca_conv(proj, *weights, None, Q_HEADS, 0, batch, *state, *footers, to_cache=cache)  # columns
        _, _, h32 = norm.residual_rms_norm(q.view(rows, -1).repeat(1, 2), norm_weight, 1e-5, residual,
                                           fp32_copy=True)
        routing = zaya_router.eda_route(**route)
    assert torch.isfinite(h32).all() and (routing.choice <= EXPERTS).all()
