"""lowp optimizers inside torch's DistributedDataParallel, on a real 2-rank gloo group (one launch
for every case): the replicas stay bit-identical with stochastic rounding although each rank
seeds torch differently (the default seed is rank 0's), and gradients that are views into DDP's
buckets (``gradient_as_bucket_view=True``, small buckets) step on the fused native kernel exactly
as on the per-tensor backend, for 16-bit and block-scaled int8 / uint8 states."""
from __future__ import annotations

import pytest
import torch

from lowp.distributed.launch import run_local_group
from lowp.optim.kernels import native_available

CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
BACKENDS = ["foreach"] + (["native"] if native_available() else [])


def _train(rank: int, seed: int | None, backend: str = "foreach", state_dtype: dict | None = None,
           bucket_view: bool = False) -> tuple[int, torch.Tensor]:
    """5 AdamW (kahan) steps of a DDP replica on the rank's own batches, torch seeded with
    ``100 + rank`` after the model is built; (the optimizer's seed, weights and states flat)."""
    import lowp.optim as lo
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4)).bfloat16()
    torch.manual_seed(100 + rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view,
                                                    bucket_cap_mb=0.002 if bucket_view else 25)
    opt = lo.AdamW(ddp.parameters(), lr=1e-3, mode="kahan", backend=backend, state_dtype=state_dtype, coded_min_numel=0,
                   **({} if seed is None else {"seed": seed}))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        ddp(torch.randn(6, 8, generator=gen).bfloat16()).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    tensors = [t for p in model.parameters() for t in (p, *(v for v in opt.state[p].values()
                                                             if torch.is_tensor(v) and v.dim()))]
    return opt.seed, torch.cat([t.detach().view(torch.uint8).flatten() for t in tensors])


def _ranks(rank: int, world_size: int) -> dict:
    out = {"default": _train(rank, None), "own": _train(rank, 100 + rank)}
    for backend in BACKENDS:
        for name, states in (("bf16", None), ("int8", CODED)):
            out[backend, name] = _train(rank, 7, backend, states, bucket_view=True)[1]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_local_group(_ranks, 2, timeout_s=60)


def test_replicas_round_alike_with_the_default_seed(ranks):
    """The default seed is rank 0's (one broadcast when the optimizer is built): the replicas
    stay bit-identical. With each rank's own seed given explicitly their stochastic roundings
    differ and they drift apart."""
    (seed0, w0), (seed1, w1) = ranks[0]["default"], ranks[1]["default"]
    assert seed0 == seed1 == 100 and torch.equal(w0, w1)
    (own0, v0), (own1, v1) = ranks[0]["own"], ranks[1]["own"]
    assert (own0, own1) == (100, 101) and not torch.equal(v0, v1)


@pytest.mark.parametrize("states", ["bf16", "int8"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bucket_view_gradients_step_alike_on_every_rank_and_backend(ranks, backend, states):
    assert torch.equal(ranks[0][backend, states], ranks[1][backend, states])
    assert torch.equal(ranks[0][backend, states], ranks[0]["foreach", states])
