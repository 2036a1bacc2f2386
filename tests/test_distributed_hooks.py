"""DDP comm hooks in real gloo process groups (spawned CPU processes, 127.0.0.1 only).

One spawned group per world size runs every hook; the parent checks the results against fp64
references and the simulator, so the multi-process start-up cost is paid once per world size,
not per hook. World size 2 runs by default, world size 4 with ``-m slow``.
"""
import os
import signal
import time

import pytest
import torch

from lowp.distributed.launch import GroupFailure, run_local_group
from lowp.distributed.simulator import ReduceConfig, reduce
from lowp.ulp import ulp

HOOK_NAMES = ["fp32", "alltoall", "stochastic", "sum_then_divide"]
STEPS = 5


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    return x, torch.randn(8, 4, generator=g) + 0.5 * rank


def _flat_grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _worker(rank, world_size):
    """Per hook: the grads DDP produces with the hook, every rank's local grads, and a short
    training run (losses and final parameters)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lowp.distributed.hooks import HOOKS, ReduceState

    out = {"local": None, "hooks": {}}
    base = _model()
    x, y = _batch(rank, 0)
    torch.nn.functional.mse_loss(base(x), y).backward()
    local = _flat_grads(base)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    out["local"] = torch.stack(gathered)
    for name in ["default"] + HOOK_NAMES:
        model = DDP(_model(), bucket_cap_mb=0.001)     # several buckets
        state = ReduceState(collect_stats=True, seed=3)
        if name != "default":
            model.register_comm_hook(state, HOOKS[name])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses, first, first_stats = [], None, None
        for step in range(STEPS):
            opt.zero_grad()
            x, y = _batch(rank, step)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if step == 0:
                first, first_stats = _flat_grads(model.module).clone(), dict(state.stats)
            opt.step()
            losses.append(float(loss.detach()))
        params = torch.cat([p.detach().reshape(-1) for p in model.module.parameters()])
        out["hooks"][name] = {"grads": first, "losses": losses, "params": params, "stats": first_stats}
    out["fsdp"] = _fsdp_grads(rank, world_size)
    out["disagree"] = _disagreement(rank)
    return out


def _disagreement(rank):
    """Rank 0 sends bf16, the others fp32: the ranks compare their settings before the all-to-all
    (whose buffers would differ in size, an abort inside gloo) and every one of them raises."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lowp.distributed.hooks import ReduceState, alltoall_fp32_hook

    model = DDP(_model())
    state = ReduceState(wire_dtype=torch.bfloat16 if rank == 0 else torch.float32)
    model.register_comm_hook(state, alltoall_fp32_hook)
    x, y = _batch(rank, 0)
    try:
        torch.nn.functional.mse_loss(model(x), y).backward()
    except ValueError as exc:
        return str(exc), state.calls
    return None, state.calls


def _fsdp_grads(rank, world_size):
    """FSDP2 ``fully_shard``, computing in bf16: every rank's local bf16 grads (all-gathered) and
    the reduced grad shards of fp32 parameters with ``param_dtype=bf16`` under ``reduce_dtype``
    None and float32 (keys ``"None"``, ``"torch.float32"``) and of bf16 parameters under None
    (``"bf16 params"``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    x, y = _batch(rank, 0)
    plain = _model().to(torch.bfloat16)
    torch.nn.functional.mse_loss(plain(x.to(torch.bfloat16)).float(), y).backward()
    local = torch.cat([p.grad.float().reshape(-1) for p in plain.parameters()])
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local)
    out = {"local": torch.stack(gathered)}
    mesh = init_device_mesh("cpu", (world_size,))
    for key, dtype, policy in (("None", torch.float32, MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
                               ("torch.float32", torch.float32,
                                MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
                               ("bf16 params", torch.bfloat16, MixedPrecisionPolicy())):
        model = _model().to(dtype)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        out[key] = [p.grad.full_tensor().float().reshape(-1) for p in model.parameters()]
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def group_results(request):
    return request.param, run_local_group(_worker, request.param, timeout_s=30)


def _exact_mean(group_results):
    R, results = group_results
    local = results[0]["local"]
    for r in range(R):
        assert torch.equal(results[r]["local"], local)     # every rank gathered the same grads
    return R, results, local.double().mean(0), local


@pytest.mark.timeout(240)
def test_fp32_hook_matches_exact_mean(group_results):
    R, results, exact, local = _exact_mean(group_results)
    for r in range(R):
        got = results[r]["hooks"]["fp32"]["grads"].double()
        assert ((got - exact).abs() <= R * 2.0**-24 * local.abs().double().mean(0) + 1e-12).all()


@pytest.mark.timeout(240)
def test_alltoall_hook_is_bit_exact_with_simulator(group_results):
    R, results, exact, local = _exact_mean(group_results)
    sim = reduce(local, ReduceConfig("alltoall", "bf16", average="post_divide"))
    for r in range(R):
        assert torch.equal(results[r]["hooks"]["alltoall"]["grads"].double(), sim)
    # and therefore inside the simulator's error bound: R compressions + one final rounding
    bound = (ulp(local.double(), "bf16") / 2).sum(0) / R + ulp(exact, "bf16") / 2 + 1e-12
    assert ((sim - exact).abs() <= bound).all()


@pytest.mark.timeout(240)
def test_stochastic_hook_within_one_ulp_per_rank_and_unbiased(group_results):
    R, results, exact, local = _exact_mean(group_results)
    got = results[0]["hooks"]["stochastic"]["grads"].double()
    for r in range(1, R):
        assert torch.equal(results[r]["hooks"]["stochastic"]["grads"].double(), got)
    bound = ulp(local.double(), "bf16").sum(0) / R + ulp(exact, "bf16") / 2 + 1e-12
    assert ((got - exact).abs() <= bound).all()
    nearest = results[0]["hooks"]["alltoall"]["grads"].double()
    assert not torch.equal(got, nearest)                   # it did round stochastically


@pytest.mark.timeout(240)
def test_sum_then_divide_hook_within_recursive_summation_bound(group_results):
    R, results, exact, local = _exact_mean(group_results)
    u = 2.0**-8
    for r in range(R):
        got = results[r]["hooks"]["sum_then_divide"]["grads"].double()
        # compression (u per term) + at most R - 1 rounded additions (gamma_{R-1} = (R-1) u / (1 - (R-1) u))
        gamma = (R - 1) * u / (1 - (R - 1) * u)
        bound = (u + gamma * (1 + u)) * local.double().abs().sum(0) / R + 1e-12
        assert ((got - exact).abs() <= bound).all()


@pytest.mark.timeout(240)
def test_training_under_each_hook_tracks_fp32(group_results):
    R, results = group_results
    ref = results[0]["hooks"]["default"]
    for name in HOOK_NAMES:
        run = results[0]["hooks"][name]
        for r in range(1, R):
            assert torch.equal(results[r]["hooks"][name]["params"], run["params"])   # replicas agree
        tol = 1e-6 if name == "fp32" else 3e-3
        assert torch.allclose(run["params"], ref["params"], atol=tol, rtol=0), name
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-2)


@pytest.mark.timeout(240)
def test_hook_stats_describe_the_gradients(group_results):
    R, results, exact, local = _exact_mean(group_results)
    stats = results[0]["hooks"]["fp32"]["stats"]
    assert sum(s.numel for s in stats.values()) == local.shape[1]
    total_mean_sq = sum(s.mean_rms**2 * s.numel for s in stats.values())
    assert total_mean_sq == pytest.approx(float((exact**2).sum()), rel=1e-4)
    spread_sq = sum(s.spread_rms**2 * s.numel for s in stats.values())
    assert spread_sq == pytest.approx(float(local.double().var(0, unbiased=True).sum()), rel=1e-3)
    assert all(s.world_size == R for s in stats.values())


@pytest.mark.timeout(240)
def test_ranks_that_disagree_on_the_wire_dtype_all_raise_naming_it(group_results):
    R, results = group_results
    for r in range(R):
        message, calls = results[r]["disagree"]
        assert message.startswith("state.wire_dtype: the ranks disagree on bucket "), message
        assert "rank 0: torch.bfloat16, rank 1: torch.float32" in message and calls == 0


@pytest.mark.timeout(240)
def test_fsdp2_reduce_dtype_none_falls_back_as_the_advisor_says_and_float32_fixes_it(group_results):
    """reduce_dtype=None reduces 16-bit parameters' gradients in bf16 on every torch, and fp32
    parameters computed in bf16 in bf16 before torch 2.15 (in fp32 from 2.15); float32 matches the
    exact mean; the advisor's check says so for this torch."""
    from lowp.distributed.advisor import FSDP_REDUCES_IN_PARAM_DTYPE, check_reduce_dtype
    from lowp.rounding import quantize

    R, results = group_results
    fsdp = results[0]["fsdp"]
    exact = fsdp["local"].double().mean(0)
    scale = fsdp["local"].double().abs().mean(0)
    grads = {key: torch.cat(fsdp[key]).double() for key in ("None", "torch.float32", "bf16 params")}
    fixed = grads["torch.float32"]
    err_fixed = (fixed - exact).abs()
    assert (err_fixed <= R * 2.0**-24 * scale + 2.0**-24 * exact.abs() + 1e-12).all()
    in_bf16 = [grads["bf16 params"]] + ([grads["None"]] if FSDP_REDUCES_IN_PARAM_DTYPE else [])
    for silent in in_bf16:
        assert torch.equal(quantize(silent, "bf16"), silent)          # reduced in bf16: bf16 values
        err_silent = (silent - exact).abs()
        assert (err_silent <= R * 2.0**-8 * scale + 1e-12).all()
        assert float(err_silent.max()) > 100 * float(err_fixed.max())
    if not FSDP_REDUCES_IN_PARAM_DTYPE:
        assert torch.equal(grads["None"], fixed)                      # fp32 parameters: reduced in fp32
    assert bool(check_reduce_dtype(None, torch.bfloat16)) == FSDP_REDUCES_IN_PARAM_DTYPE
    assert check_reduce_dtype(None, None, torch.bfloat16)
    assert not check_reduce_dtype(torch.float32, torch.bfloat16)


def _dies(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(4))


def _crashes_in_native_code(rank, world_size):
    import faulthandler

    faulthandler._sigsegv()   # a segmentation fault, as a bug in C code would raise


def _hangs(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        time.sleep(120)
    dist.all_reduce(torch.ones(4))


@pytest.mark.timeout(90)
def test_hung_rank_makes_the_others_fail_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(GroupFailure) as info:
        run_local_group(_hangs, 2, timeout_s=3, join_timeout_s=25)
    elapsed = time.monotonic() - start
    assert elapsed < 40
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
    assert "terminated" in info.value.ranks[1]
    assert info.value.ranks[0] != info.value.ranks[1]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_dead_rank_makes_the_others_fail():
    start = time.monotonic()
    with pytest.raises(GroupFailure) as info:
        run_local_group(_dies, 2, timeout_s=5, join_timeout_s=25)
    assert time.monotonic() - start < 40
    assert "exit code 3" in info.value.ranks[1]
    assert "rank 0" in str(info.value)


@pytest.mark.timeout(60)
def test_a_rank_killed_by_a_signal_is_reported_with_its_python_stack():
    with pytest.raises(GroupFailure) as info:
        run_local_group(_crashes_in_native_code, 1, timeout_s=5, join_timeout_s=30)
    report = info.value.ranks[0]
    assert f"exit code -{signal.SIGSEGV.value}" in report
    assert "Segmentation fault" in report and "_crashes_in_native_code" in report


def test_launcher_and_state_reject_bad_arguments():
    from lowp.distributed.hooks import ReduceState

    with pytest.raises(ValueError, match="world_size"):
        run_local_group(_dies, 0)
    with pytest.raises(ValueError, match="timeout_s"):
        run_local_group(_dies, 2, timeout_s=0)
    with pytest.raises(ValueError, match="wire_dtype"):
        ReduceState(wire_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("kw, error, match", [
    ({"wire_dtype": None}, ValueError, "^wire_dtype: "), ({"gather_dtype": "fp32"}, ValueError, "^gather_dtype: "),
    ({"seed": None}, ValueError, "^seed: expected an int"), ({"seed": True}, ValueError, "^seed: "),
    ({"seed": 1.5}, ValueError, "^seed: "), ({"calls": -1}, ValueError, "^calls: expected an int >= 0"),
    ({"collect_stats": "yes"}, ValueError, "^collect_stats: "), ({"stats": None}, TypeError, "^stats: "),
    ({"process_group": -100}, TypeError, "^process_group: expected a torch.distributed.ProcessGroup or None"),
])
def test_state_refuses_fields_the_hooks_cannot_use(kw, error, match):
    from lowp.distributed.hooks import ReduceState

    with pytest.raises(error, match=match):
        ReduceState(**kw)


def test_state_accepts_any_integer_seed():
    import numpy as np

    from lowp.distributed.hooks import ReduceState

    assert ReduceState(seed=np.int64(3)).seed == 3 and type(ReduceState(seed=np.int64(3)).seed) is int
    assert ReduceState(seed=-1).seed == -1 and ReduceState(seed=2**100).seed == 2**100


class _Bucket:
    """What the hooks read of a GradBucket."""

    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer

    def index(self):
        return 0


def test_hooks_check_state_and_bucket_before_any_collective():
    """No process group here: every refusal comes before the hooks would need one, and a state
    changed after it was made is caught at the call, its counters untouched."""
    import torch.distributed as dist

    from lowp.distributed.hooks import HOOKS, ReduceState

    for hook in HOOKS.values():
        with pytest.raises(TypeError, match="^state: expected a lowp.distributed.hooks.ReduceState, got NoneType"):
            hook(None, _Bucket(torch.ones(4)))
        with pytest.raises(TypeError, match="^bucket: expected a torch.distributed.GradBucket"):
            hook(ReduceState(), torch.ones(4))
        with pytest.raises(TypeError, match="^bucket: gradients of dtype torch.int32"):
            hook(ReduceState(), _Bucket(torch.ones(4, dtype=torch.int32)))
        with pytest.raises(TypeError, match="^bucket: on the meta device"):
            hook(ReduceState(), _Bucket(torch.ones(4, device="meta")))
        state = ReduceState()
        state.seed = "x"
        with pytest.raises(ValueError, match="^state.seed: expected an int, got 'x'"):
            hook(state, _Bucket(torch.ones(4)))
        assert state.calls == 0
    for hook in (HOOKS["alltoall"], HOOKS["stochastic"]):
        with pytest.raises(TypeError, match="^bucket: a sparse gradient"):
            hook(ReduceState(), _Bucket(torch.ones(4).to_sparse()))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="^process_group: None means torch.distributed's default group"):
            HOOKS["fp32"](ReduceState(), _Bucket(torch.ones(4)))


def test_stochastic_streams_of_distinct_ranks_and_calls_never_collide():
    from lowp.distributed.hooks import _stream_seed

    seeds = {_stream_seed(3, rank, call) for rank in range(64) for call in range(2 * 7919 + 8)}
    assert len(seeds) == 64 * (2 * 7919 + 8)
    assert all(0 <= s < 2**64 for s in seeds)
    # the old linear mix seed*1_000_003 + rank*7919 + call made these two equal
    assert _stream_seed(3, 1, 5) != _stream_seed(3, 0, 5 + 7919)
    assert _stream_seed(0, 0, 0) != _stream_seed(1, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        _stream_seed(0, -1, 0)


def test_stochastic_compression_draws_different_bits_on_formerly_colliding_ranks(monkeypatch):
    import torch.distributed as dist

    from lowp.distributed import hooks

    values = torch.full((4096,), 1.0 + 2.0**-10)        # halfway between two bf16 values
    results = []
    for rank, calls in [(1, 5), (0, 5 + 7919)]:
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        state = hooks.ReduceState(seed=3, calls=calls)
        results.append(hooks._compress(state, values, stochastic=True))
    assert set(results[0].float().unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert not torch.equal(results[0], results[1])
