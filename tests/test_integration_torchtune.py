"""lowp optimizers in torchtune recipes (:mod:`lowp.integrations.torchtune`): the optimizer
section's ``_component_`` builds a lowp optimizer from YAML values (dtype names), and the
full-finetune distributed recipe's checkpoint calls resume a differently seeded run bit for bit on
2 gloo ranks with FSDP2, with the default configuration and with exact8 + int8/uint8 states, for
both of its optimizer loaders.

torchtune itself is not imported: 0.6.1 (the current release) fails to import beside torchao 0.18
(``torchao.dtypes.nf4tensor`` is gone), so tests/integration_torchtune_worker.py reproduces its
calls from its source, with the same ``StateDictOptions``."""
from __future__ import annotations

import pytest
import torch

import integration_torchtune_worker as w
import lowp.optim as lo
from lowp.distributed.launch import run_local_group
from lowp.integrations.torchtune import build_optimizer
from lowp.threads import single_thread
from nested_equal import assert_nested_equal


def _params():
    torch.manual_seed(0)
    return list(torch.nn.Linear(8, 4).bfloat16().parameters())


def test_component_reads_yaml_values():
    """What torchtune's ``config.instantiate`` passes: the parameters, then the section's keys as
    YAML gives them (strings for dtypes, a list for betas)."""
    opt = build_optimizer(_params(), optimizer="AdamW", lr=2e-5, betas=[0.9, 0.95], mode="exact8",
                          state_dtype={"exp_avg": "int8", "exp_avg_sq": "uint8"}, state_scale_dtype="float32")
    assert type(opt) is lo.AdamW
    group = opt.param_groups[0]
    assert group["state_dtype"] == {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
    assert (group["betas"], group["mode"], group["state_scale_dtype"]) == ((0.9, 0.95), "exact8", torch.float32)
    lion = build_optimizer(_params(), optimizer="lowp.Lion", lr=1e-4, state_dtype="bfloat16")
    assert type(lion) is lo.Lion and lion.param_groups[0]["state_dtype"] == torch.bfloat16
    # optimizer_in_bwd: one optimizer per parameter, each given a one-element list
    assert len(build_optimizer([_params()[0]], lr=1e-3).param_groups[0]["params"]) == 1


def test_component_refuses_what_lowp_does_not_take():
    with pytest.raises(ValueError, match="names no lowp optimizer"):
        build_optimizer(_params(), optimizer="AdamW8bit")
    with pytest.raises(ValueError, match="torch dtype or its name"):
        build_optimizer(_params(), state_dtype="int9")
    with pytest.raises(TypeError, match="state_dtype="):   # bitsandbytes' keyword: lowp's equivalent named
        build_optimizer(_params(), optim_bits=8)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("torchtune"))
    with single_thread():
        saved = run_local_group(w.train_and_save, 2, folder, timeout_s=120)
        resumed = run_local_group(w.resume, 2, folder, timeout_s=120)
    return folder, saved, resumed


def test_recipe_state_holds_the_lowp_state(runs):
    """The rank-0 file loads with ``weights_only=True`` and holds full (gathered) states in their
    own dtypes, dtype names in the groups and the extras in every group."""
    folder, saved, _ = runs
    for config in w.CONFIGS:
        state = torch.load(f"{folder}/{config}/recipe_state.pt", weights_only=True)["optimizer"]
        entry = state["state"]["0.weight"]
        assert entry["exp_avg"].shape[0] == 64 and not isinstance(entry["exp_avg"], torch.distributed.tensor.DTensor)
        group = state["param_groups"][0]
        assert group["lowp"]["seed"] == w.SAVE_SEED and group["lowp"]["skipped_params"] == 1
        if config == "exact8":
            assert (entry["exp_avg"].dtype, entry["exp_avg_sq"].dtype) == (torch.int8, torch.uint8)
            assert group["state_dtype"] == {"exp_avg": "torch.int8", "exp_avg_sq": "torch.uint8"}
            assert entry["remainder8"].dtype == torch.int8
        else:
            assert entry["compensation"].dtype == torch.bfloat16


@pytest.mark.parametrize("loader", w.LOADERS)
@pytest.mark.parametrize("config", list(w.CONFIGS))
def test_resume_is_bit_identical(runs, config, loader):
    _, saved, resumed = runs
    for rank in range(2):
        full, again = saved[rank][config], resumed[rank][f"{config}/{loader}"]
        assert full["sharded"] and full["skipped_params"] == 1 and full["seed"] == w.SAVE_SEED
        assert resumed[rank][f"{config}/{loader}/fresh_seed"] == w.LOAD_SEED
        assert_nested_equal(full, again, f"rank {rank}")
