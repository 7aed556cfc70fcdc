"""Context parallelism on CPU: two gloo ranks run a tiny model's forward with the sequence split
between them (torchtitan's CP through consumers/trainer/parallel/context.py), and the gathered
logits are checked against a single-process forward of the same weights. What CPU CP cannot do
(train; SDPA at all) is asserted too, so these tests fail the day torch starts doing it and the
module's docstring should change."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from jetrl.consumers.trainer.parallel.context import apply_context_parallel, gather_sequence, shard_batch
from jetrl.policy.models import build_model, get_config
from tests.consumers.parallel._cp_launch import launch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
]

WORLD = 2
SEED = 0
CONFIGS = ("tiny-dense", "tiny-moe")
# Flex CP needs the length divisible by cp * 128 (torch's block size): 256 is the least for 2
# ranks, and the tiny configs' max_seq_len.
BATCH, SEQ = 2, 256


def _tokens() -> torch.Tensor:
    vocab = get_config(CONFIGS[0]).vocab_size  # the tiny configs share one vocabulary
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _error(fn: Callable[[], object]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # what the rank measured, for the test to assert
        return type(e).__name__, str(e)
    return None


def cp_ranks(rank: int, world: int, out_dir: Path) -> None:
    """One rank's side, run by the launcher: results go to ``rank{rank}.pt``."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    tokens = _tokens()
    result: dict[str, Any] = {}
    for name in CONFIGS:
        model = build_model(get_config(name, attention="flex"), seed=SEED)
        apply_context_parallel(model, mesh)
        batch = shard_batch(model, tokens, mesh)
        with torch.no_grad():
            local = model(batch.tokens, **batch.model_kwargs())
        result[name] = {"logits": gather_sequence(local, mesh), "positions": batch.positions}
    # Training: the same forward, recording for autograd, then its backward.
    result["backward"] = _error(lambda: model(batch.tokens, **batch.model_kwargs()).sum().backward())
    result["short"] = _error(lambda: shard_batch(model, tokens[:, : SEQ - 64], mesh))
    sdpa = build_model(get_config(CONFIGS[0]), seed=SEED)  # jetrl's CPU attention, CachedSDPA
    apply_context_parallel(sdpa, mesh)
    sdpa_batch = shard_batch(sdpa, tokens, mesh)
    with torch.no_grad():
        result["sdpa"] = _error(lambda: sdpa(sdpa_batch.tokens, **sdpa_batch.model_kwargs()))
    torch.save(result, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("cp")
    launch("tests.consumers.parallel.test_context_parallel:cp_ranks", WORLD, out, timeout_s=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


@pytest.mark.parametrize("name", CONFIGS)
def test_cp_forward_matches_single_process(ranks: list[dict[str, Any]], name: str) -> None:
    # The single-process reference: jetrl's CPU model (causal SDPA), same seed, same weights.
    with torch.no_grad():
        ref = build_model(get_config(name), seed=SEED)(_tokens())
    # Measured: at most 1.8e-7 off (logits up to 0.66), i.e. a few fp32 ulps, never bit-equal:
    # each rank's attention reduces over a differently cut sequence, flex's kernel is not the
    # single-process SDPA kernel, and the GEMMs see [B, L/2] rows instead of [B, L], so sums
    # are associated differently. A real mistake is far larger (RoPE left at 0..L/2-1 on each
    # rank, i.e. positions not passed: 0.1 off).
    # Every rank gathers the whole sequence: compare them all (dim 0 of a mismatch is the rank).
    gathered = torch.stack([res[name]["logits"] for res in ranks])
    torch.testing.assert_close(gathered, ref.expand_as(gathered), rtol=1e-5, atol=1e-5)


def test_cp_shards_head_tail(ranks: list[dict[str, Any]]) -> None:
    # torchtitan's default load balancer: the sequence cut in 2 * cp chunks, rank r holding
    # chunk r and chunk 2 * cp - 1 - r, so causal attention costs each rank the same.
    chunks = torch.arange(SEQ).chunk(2 * WORLD)
    for r, res in enumerate(ranks):
        expected = torch.cat([chunks[r], chunks[2 * WORLD - 1 - r]]).expand(BATCH, -1)
        for name in CONFIGS:
            assert torch.equal(res[name]["positions"], expected)


def test_cp_backward_raises_on_cpu(ranks: list[dict[str, Any]]) -> None:
    # Flex attention has no CPU backward, CP or not; CP training is for a GPU.
    for res in ranks:
        assert res["backward"] == (
            "NotImplementedError",
            "FlexAttention does not support backward on CPU. "
            "Please set the input requires_grad to False or use another device.",
        )


def test_cp_sdpa_has_no_cpu_rule(ranks: list[dict[str, Any]]) -> None:
    # torch's CP dispatcher knows the CUDA SDPA kernels only, not the CPU flash kernel.
    for res in ranks:
        assert res["sdpa"] == (
            "NotImplementedError",
            "Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
            "does not have a sharding strategy registered.",
        )


def test_cp_length_checked(ranks: list[dict[str, Any]]) -> None:
    for res in ranks:
        kind, message = res["short"]
        assert kind == "ValueError" and "cp * 128" in message
