"""lowp optimizers chosen in torchtitan's configuration (:mod:`lowp.integrations.torchtitan`):
``LowpOptimizersContainer`` resolves ``optimizer_name="lowp.AdamW"``, translates torchtitan's
``implementation`` flags, reads dtype names and mixes with torch's optimizers; on 2 gloo ranks
with FSDP2, torchtitan's own ``CheckpointManager`` (flat FQN-keyed optimizer state through
torch.distributed.checkpoint) resumes a differently seeded run bit for bit, with the default
configuration and with exact8 + int8/uint8 states (tests/integration_torchtitan_worker.py)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.components.optimizer", reason="torchtitan is not installed")

import integration_torchtitan_worker as w  # noqa: E402
from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

import lowp.optim as lo  # noqa: E402
from lowp.distributed.launch import run_local_group  # noqa: E402
from lowp.integrations.torchtitan import (LowpOptimizersContainer, implementation_options,  # noqa: E402
                                          lowp_adamw, lowp_optimizer_names)
from lowp.threads import single_thread  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).bfloat16()


def _train(model, optimizers, steps=2):
    for t in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t)).bfloat16()
        model(x).float().square().mean().backward()
        optimizers.step()
        optimizers.zero_grad()


def test_names_resolve_to_lowp_optimizers():
    assert "lowp.AdamW" in lowp_optimizer_names() and "lowp.Lion" in lowp_optimizer_names()
    for name in lowp_optimizer_names():
        factory = LowpOptimizersContainer._resolve_optimizer_factory(name)
        assert factory.__name__ == "build_" + name.removeprefix("lowp.")
    assert LowpOptimizersContainer._resolve_optimizer_factory("AdamW") is torch.optim.AdamW
    with pytest.raises(ValueError, match="names no lowp optimizer"):
        LowpOptimizersContainer._resolve_optimizer_factory("lowp.AdamX")


def test_lowp_adamw_builds_the_container_from_config():
    """``Config.build`` (what torchtitan's trainer calls) makes the lowp container; group options
    given as names (a config file's spelling) become dtypes; torchtitan's defaults
    (``implementation="fused"``) leave lowp's automatic backend choice."""
    model = _model()
    config = lowp_adamw(lr=1e-3, mode="exact8", state_dtype="int8/uint8", coded_min_numel=0, factory_kwargs={"seed": 5})
    optimizers = config.build(model_parts=[model])
    assert type(optimizers) is LowpOptimizersContainer
    (opt,) = optimizers.optimizers
    assert type(opt) is lo.AdamW and opt.seed == 5
    (group,) = opt.param_groups
    assert group["state_dtype"] == {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
    assert (group["mode"], group["betas"], group["weight_decay"]) == ("exact8", (0.9, 0.95), 0.1)
    assert group["param_names"] == [n for n, _ in model.named_parameters()]
    assert "fused" not in group and "foreach" not in group
    assert opt.backend.name == lo.AdamW(_model().parameters()).backend.name   # lowp's own choice
    _train(model, optimizers)
    assert opt.state[model[0].weight]["exp_avg"].dtype == torch.int8


@pytest.mark.parametrize("implementation,backend", [("foreach", "foreach"), ("for-loop", "eager")])
def test_implementation_picks_the_backend(implementation, backend):
    config = lowp_adamw(lr=1e-3)
    config.implementation = implementation
    (opt,) = config.build(model_parts=[_model()]).optimizers
    assert opt.backend.name == backend
    config.optimizer_factory_kwargs_by_name = {"lowp.AdamW": {"backend": "eager"}}   # factory keywords win
    config.implementation = "foreach"
    (opt,) = config.build(model_parts=[_model()]).optimizers
    assert opt.backend.name == "eager"


def test_one_optimizer_refuses_mixed_implementations():
    groups = [{"fused": True, "foreach": False}, {"fused": False, "foreach": True}]
    with pytest.raises(ValueError, match="different implementations"):
        implementation_options(groups, "lowp.AdamW")


def test_lowp_and_torch_optimizers_in_one_container():
    """Biases with ``torch.optim.AdamW``, the weights with lowp's AdamW (fp32 states by name): two
    optimizers in one container, one flat checkpoint dict that loads back into both."""
    model = _model()
    config = LowpOptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=r"bias$", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3}),
                      ParamGroupConfig(pattern=r".*", optimizer_name="lowp.AdamW",
                                       optimizer_kwargs={"lr": 1e-3, "state_dtype": "float32"})])
    optimizers = config.build(model_parts=[model])
    torch_opt, lowp_opt = sorted(optimizers.optimizers, key=lambda o: type(o).__module__.startswith("lowp"))
    assert type(torch_opt) is torch.optim.AdamW and type(lowp_opt) is lo.AdamW
    assert lowp_opt.param_groups[0]["param_names"] == ["0.weight", "2.weight"]
    _train(model, optimizers)
    saved = optimizers.state_dict()
    assert saved["param_groups.0.weight.state_dtype"] == "torch.float32"   # names, not dtypes
    assert saved["param_groups.0.weight.lowp"]["seed"] == lowp_opt.seed
    assert saved["state.0.weight.exp_avg"].dtype == torch.float32
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in saved.items()}
    _train(model, optimizers, steps=1)
    optimizers.load_state_dict(before)
    assert_nested_equal(optimizers.state_dict(), before)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("torchtitan"))
    with single_thread():
        saved = run_local_group(w.train_and_save, 2, folder, timeout_s=120)
        resumed = run_local_group(w.resume, 2, folder, timeout_s=120)
    return saved, resumed, folder


@pytest.mark.parametrize("config", list(w.CONFIGS))
def test_checkpointer_resume_is_bit_identical(runs, config):
    saved, resumed, _ = runs
    for rank in range(2):
        full, again = saved[rank][config], resumed[rank][config]
        assert full["sharded"] and full["skipped_params"] == 1
        loaded, step, fresh_seed = resumed[rank][f"{config}/loaded"]
        assert loaded and step == w.SAVE_AT and fresh_seed == w.LOAD_SEED != full["seed"] == w.SAVE_SEED
        assert_nested_equal(full, again, f"rank {rank}")
    if config == "exact8":
        states = saved[0][config]
        assert states["0.weight/exp_avg"].dtype == torch.int8 and states["0.weight/exp_avg_sq"].dtype == torch.uint8
        assert states["0.weight/remainder8"].dtype == torch.int8
    else:
        assert saved[0][config]["0.weight/compensation"].dtype == torch.bfloat16


def test_a_checkpoint_of_another_layout_is_refused_on_resume(runs, tmp_path_factory):
    """torchtitan's checkpointer (``dcp.load`` into the optimizers' own states, then
    ``set_state_dict``) resuming the exact8 run (codes at every size) with the default threshold
    (16-bit states under 4096 elements): refused on both ranks naming the entry and the saved
    option, and the next step refuses the states the load wrote into."""
    folder = runs[2]
    with single_thread():
        out = run_local_group(w.resume_with_the_default_threshold, 2, folder, timeout_s=120)
    for rank, res in enumerate(out):
        assert "arrived as bfloat16, the dtype this optimizer's options give it" in res.get("load", ""), (rank, res)
        assert "coded_min_numel=0) store it as int8: it looks cast" in res["load"], rank
        assert "this optimizer's states hold what a loader wrote into them" in res.get("step", ""), (rank, res)
