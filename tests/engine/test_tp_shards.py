"""What each tensor-parallel rank holds after a prefill (gloo on CPU, one process per rank, driven symmetrically):
ZAYA1's conv state is the rank's rows of the TP=1 conv state (its q channels, then its k channels) and the lag is
replicated; Ling's lightning state is the rank's heads of the TP=1 state; the logits equal TP=1's. And the MOD
rule: the scaled-identity skip term is replicated on every rank, so it must enter the reduced sum once — added on
every rank before the all-reduce (the first vLLM port's mistake) it changes the output."""
from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from hybridserve.config import EngineConfig
from hybridserve.core.batch import build_forward_batch
from hybridserve.core.chunk import ScheduledChunk
from hybridserve.runtime.tensor_parallel import free_local_port

PAGE = 4
PROMPT = [3 + (11 * j) % 97 for j in range(40)]


def _rank_main(rank: int, size: int, address: str, directory: str, premask_every_rank: bool, out: str) -> None:
    from hybridserve.core.parallel import all_reduce
    from hybridserve.models import zaya
    from hybridserve.runtime.model_runner import ModelRunner
    from hybridserve.runtime.tensor_parallel import init_group

    torch.set_num_threads(1)
    init_group(rank, size, address, torch.device("cpu"))
    skips, route_tokens = [], zaya.EDARouter.forward

    def counting(self, x32, carry):  # how many tokens take the MOD skip class (the test needs some)
        route = route_tokens(self, x32, carry)
        skips.append(int((route.skip_weight > 0).sum()))
        return route

    zaya.EDARouter.forward = counting
    if premask_every_rank:  # the skip term added to each rank's partial sum before the reduce
        def forward(self, x, route, norm):
            partial = self.experts(x, route.expert_ids, route.expert_weights) + route.skip_weight * x
            x_new, h, _ = norm(all_reduce(partial))
            return x_new, h, route.carry

        zaya.ZayaMoE.forward = forward
    runner = ModelRunner(EngineConfig(model=directory, device="cpu", dtype="float32", page_size=PAGE,
                                      kv_cache_memory_bytes=16 << 20), directory)
    runner.create_tables(2, 64)
    pages = list(range(1, 1 + -(-len(PROMPT) // PAGE)))
    chunk = ScheduledChunk(PROMPT, 0, pages, 1, False, list(range(len(PROMPT))), table_row=0,
                           window_page_ids=list(pages) if runner.sliding_window is not None else None)
    runner.tables.reset([0])
    with torch.inference_mode():
        batch = build_forward_batch([chunk], PAGE, runner.device, runner.model.history_len, runner.tables)
        logits = runner.model.compute_logits(runner.model(batch)[batch.logits_indices])
    torch.save({"logits": logits, "state": {k: v[:, 1].clone() for k, v in runner.state_pool.buffers.items()},
                "skips": sum(skips)}, f"{out}/rank{rank}.pt")
    torch.distributed.barrier()  # no rank leaves while another still talks to it (gloo aborts on a closed peer)
    torch.distributed.destroy_process_group()


def _run(directory, size: int, tmp_path, premask_every_rank: bool = False) -> list[dict]:
    address = f"tcp://127.0.0.1:{free_local_port()}"
    out = tmp_path / f"tp{size}-{premask_every_rank}"
    out.mkdir()
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_rank_main, args=(r, size, address, str(directory), premask_every_rank,
                                                      str(out))) for r in range(size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
        assert process.exitcode == 0
    return [torch.load(out / f"rank{r}.pt") for r in range(size)]


def test_zaya_conv_rows_lag_and_logits_per_rank(zaya_dir, tmp_path):
    (one,), two = _run(zaya_dir, 1, tmp_path), _run(zaya_dir, 2, tmp_path)
    from hybridserve.checkpoint import read_config

    config = read_config(zaya_dir)
    hq, hk, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    for rank, part in enumerate(two):
        torch.testing.assert_close(part["logits"], one["logits"], rtol=1e-5, atol=1e-5)
        q = slice(rank * hq // 2 * d, (rank + 1) * hq // 2 * d)
        k = slice(hq * d + rank * hk // 2 * d, hq * d + (rank + 1) * hk // 2 * d)
        want = torch.cat([one["state"]["conv"][:, q], one["state"]["conv"][:, k]], dim=1)
        torch.testing.assert_close(part["state"]["conv"], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(part["state"]["lag"], one["state"]["lag"], rtol=1e-5, atol=1e-6)


def test_ling_lightning_heads_and_logits_per_rank(ling_dir, tmp_path):
    (one,), two = _run(ling_dir, 1, tmp_path), _run(ling_dir, 2, tmp_path)
    heads = one["state"]["lightning"].shape[1]
    for rank, part in enumerate(two):
        torch.testing.assert_close(part["logits"], one["logits"], rtol=1e-5, atol=1e-5)
        mine = slice(rank * heads // 2, (rank + 1) * heads // 2)
        torch.testing.assert_close(part["state"]["lightning"], one["state"]["lightning"][:, mine],
                                   rtol=1e-5, atol=1e-5)  # fp32 sums over two layers in another order


@pytest.fixture(scope="module")
def mod_dir(zaya_dir, tmp_path_factory):
    """The tiny ZAYA1 with the skip class's balancing bias raised from -1 to +0.05, so tokens take it."""
    import shutil

    from safetensors.torch import load_file, save_file

    directory = tmp_path_factory.mktemp("zaya-mod")
    for path in zaya_dir.iterdir():
        shutil.copy(path, directory / path.name)
    tensors = load_file(directory / "model.safetensors")
    for name, tensor in tensors.items():
        if name.endswith("balancing_biases"):
            tensor[-1] = 0.05
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


def test_the_mod_skip_term_enters_the_reduced_sum_once(mod_dir, tmp_path):
    """ZAYA1's default MOD mode (scaled identity), with tokens taking the skip class: the engine's rule (added
    once, after the reduce) equals TP=1; adding it on both ranks does not."""
    from hybridserve.checkpoint import read_config

    assert read_config(mod_dir).get("mod_skip_mode", "scaled_identity") == "scaled_identity"
    (one,) = _run(mod_dir, 1, tmp_path)
    assert one["skips"] > 0
    rule = _run(mod_dir, 2, tmp_path)[0]["logits"]
    doubled = _run(mod_dir, 2, tmp_path, premask_every_rank=True)[0]["logits"]
    torch.testing.assert_close(rule, one["logits"], rtol=1e-5, atol=1e-5)
    assert (doubled - one["logits"]).abs().max() > 1e-3
    with pytest.raises(AssertionError):
        torch.testing.assert_close(doubled, one["logits"], rtol=1e-5, atol=1e-5)
