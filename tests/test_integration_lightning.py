"""lowp optimizers inside PyTorch Lightning: ``configure_optimizers`` returns a lowp AdamW and
``lightning.Trainer(precision="bf16-true")`` trains a small regression MLP on CPU. Lightning's
``ModelCheckpoint`` files hold the whole lowp state, ``fit(ckpt_path=...)`` continues bit for
bit like the uninterrupted run, and Lightning's ``optimizer.step(closure)`` runs the closure
(forward and backward) once per step. With fp32 weights, ``"bf16-mixed"`` and a GradScaler
``"16-mixed"`` plugin work too, and so does the 5-byte configuration (one-byte remainders, int8 /
uint8 block-scaled moments). Each training runs once per module (``trained``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins import HalfPrecision, MixedPrecision  # noqa: E402

from lowp.optim import AdamW  # noqa: E402
from lowp.optim.clip import clip_grad_norm_, grad_norm  # noqa: E402
from lowp.optim.convert import cast_model  # noqa: E402
from lowp.threads import single_thread  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402

BATCHES, EPOCHS, RESUME_EPOCH = 6, 4, 1     # 6 steps an epoch; resumed from the end of epoch 1
STEPS = BATCHES * EPOCHS
MODES = ("kahan", "exact", "stochastic", "exact8-codes")
#: "exact8-codes": AdamW at about 5 bytes per parameter (lowp memory's recommendation)
CODED = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}


def _options(mode: str) -> dict:
    """The optimizer's keyword arguments of a ``MODES`` entry."""
    return {"mode": "exact8", "state_dtype": CODED, "coded_min_numel": 0} if mode == "exact8-codes" else {"mode": mode}


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCHES * 16, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) / 4
    # a fixed order: Lightning restores loops, not a shuffling sampler's generator
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


class Regression(L.LightningModule):
    """Linear -> LayerNorm -> GELU -> Linear; counts closure runs (forward + backward)."""

    def __init__(self, mode: str = "kahan", optimizer: str = "lowp") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 1))
        self.mode, self.optimizer_kind = mode, optimizer
        self.forwards = self.backwards = 0
        self.losses: list[float] = []
        self.clipped: list[tuple[float, float]] = []   # (unscaled norm before, after) per clipping

    def training_step(self, batch, batch_idx):
        self.forwards += 1
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self) -> None:
        self.backwards += 1

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Under "16-mixed"/"bf16-mixed" Lightning refuses to clip for an optimizer that unscales
        inside its step (lowp's do); lowp's clip_grad_norm_ divides the norm by the scale itself."""
        if not isinstance(self.trainer.precision_plugin, MixedPrecision):
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        scaler = self.trainer.precision_plugin.scaler
        before = clip_grad_norm_(self.parameters(), gradient_clip_val, scaler=scaler)
        self.clipped.append((before, grad_norm(self.parameters(), scaler=scaler)))

    def configure_optimizers(self):
        if self.optimizer_kind == "torch":
            return torch.optim.AdamW(self.parameters(), lr=1e-2)
        return AdamW(self.parameters(), lr=1e-2, **_options(self.mode))


class LowpBf16(HalfPrecision):
    """``"bf16-true"`` that keeps normalization layers in fp32: Lightning's own plugin casts the
    whole module (``module.to(torch.bfloat16)``), :func:`cast_model` keeps the norms."""

    def __init__(self) -> None:
        super().__init__("bf16-true")

    def convert_module(self, module: nn.Module) -> nn.Module:
        return cast_model(module, torch.bfloat16)


@dataclass
class Run:
    module: Regression
    trainer: "L.Trainer"
    out: Path

    def checkpoint(self, epoch: int) -> Path:
        return self.out / f"epoch={epoch}-step={(epoch + 1) * BATCHES}.ckpt"

    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizers[0]


def _fit(out: Path, mode: str = "kahan", resume: Path | None = None, precision: str | None = "bf16-true",
         plugins: list | None = None, optimizer: str = "lowp", steps: int = STEPS, clip: float | None = 0.5) -> Run:
    module = Regression(mode, optimizer)
    # saved after the epoch's last step: Lightning 2.6 resumes an on_train_epoch_end checkpoint
    # (every_n_epochs) with one extra batch of the finished epoch, so that resume is not exact
    checkpoints = ModelCheckpoint(dirpath=out, every_n_train_steps=BATCHES, save_top_k=-1)
    trainer = L.Trainer(accelerator="cpu", precision=precision, plugins=plugins, max_steps=steps,
                        enable_progress_bar=False, logger=False, enable_model_summary=False,
                        callbacks=[checkpoints], gradient_clip_val=clip)
    trainer.fit(module, _data(), ckpt_path=None if resume is None else str(resume))
    return Run(module, trainer, out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Per mode the uninterrupted and the resumed "bf16-true" run; the fp32-norm plugin (both
    runs); fp32 weights under "bf16-mixed" with lowp and torch.optim; and a GradScaler plugin."""
    runs: dict[str, Run] = {}
    with single_thread():
        for mode in MODES:
            out = tmp_path_factory.mktemp(f"pl-{mode}")
            runs[mode] = _fit(out, mode)
            runs[f"{mode}-resumed"] = _fit(out, mode, resume=runs[mode].checkpoint(RESUME_EPOCH))
        out = tmp_path_factory.mktemp("pl-norms")
        runs["norms"] = _fit(out, precision=None, plugins=[LowpBf16()])
        runs["norms-resumed"] = _fit(out, precision=None, plugins=[LowpBf16()],
                                     resume=runs["norms"].checkpoint(RESUME_EPOCH))
        for optimizer in ("lowp", "torch"):
            runs[f"mixed-{optimizer}"] = _fit(tmp_path_factory.mktemp("pl-mixed"), precision="bf16-mixed",
                                              optimizer=optimizer, steps=2 * BATCHES)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        runs["fp16"] = _fit(tmp_path_factory.mktemp("pl-fp16"), precision=None, steps=2 * BATCHES,
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    return runs


def _epoch_means(losses: list[float]) -> list[float]:
    return [sum(losses[i:i + BATCHES]) / BATCHES for i in range(0, len(losses), BATCHES)]


@pytest.mark.parametrize("mode", MODES)
def test_loss_goes_down_and_the_closure_runs_once_per_step(trained, mode):
    run = trained[mode]
    assert run.trainer.global_step == STEPS
    assert run.module.forwards == run.module.backwards == STEPS     # Lightning's closure: once per step
    assert all(int(s["step"]) == STEPS for s in run.optimizer().state.values())
    means = _epoch_means(run.module.losses)
    assert means[-1] < 0.5 * means[0]


@pytest.mark.parametrize("mode", MODES)
def test_checkpoint_holds_the_lowp_state(trained, mode):
    run = trained[mode]
    saved = torch.load(run.checkpoint(RESUME_EPOCH), weights_only=False)["optimizer_states"][0]
    params = list(run.module.parameters())
    assert len(saved["state"]) == len(params) and {p.dtype for p in params} == {torch.bfloat16}
    buffer = {"kahan": ("compensation", torch.bfloat16), "exact": ("remainder", torch.int16),
              "exact8-codes": ("remainder8", torch.int8)}.get(mode)
    for i, p in enumerate(params):
        entry = saved["state"][i]
        assert int(entry["step"]) == (RESUME_EPOCH + 1) * BATCHES
        if mode == "exact8-codes":   # codes in their own dtypes, their bf16 block scales beside them
            assert (entry["exp_avg"].dtype, entry["exp_avg_sq"].dtype) == (torch.int8, torch.uint8)
            assert entry["exp_avg_scale"].dtype == entry["exp_avg_sq_scale"].dtype == torch.bfloat16
        else:
            assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == torch.bfloat16
        if buffer is None:
            assert not {"compensation", "remainder"} & entry.keys()
        else:
            name, dtype = buffer
            assert entry[name].dtype == dtype and entry[name].shape == p.shape
            assert entry[name].count_nonzero() > 0       # the buffer holds what bf16 could not
    assert saved["param_groups"][0]["lowp"]["seed"] == run.optimizer().seed


@pytest.mark.parametrize("mode", [*MODES, "norms"])
def test_resume_is_bit_identical(trained, mode):
    full, resumed = trained[mode], trained[f"{mode}-resumed"]
    assert resumed.trainer.global_step == STEPS
    done = (RESUME_EPOCH + 1) * BATCHES
    assert resumed.module.forwards == resumed.module.backwards == STEPS - done
    assert resumed.module.losses == full.module.losses[done:]
    for (name, a), b in zip(full.module.named_parameters(), resumed.module.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert_nested_equal(full.optimizer().state_dict(), resumed.optimizer().state_dict())


def test_bf16_true_casts_the_norms_unless_the_plugin_keeps_them(trained):
    assert trained["kahan"].module.net[1].weight.dtype == torch.bfloat16     # Lightning: module.to(bf16)
    run = trained["norms"]
    assert run.module.net[1].weight.dtype == torch.float32 and run.module.net[0].weight.dtype == torch.bfloat16
    state = run.optimizer().state
    assert "compensation" in state[run.module.net[0].weight]
    assert not {"compensation", "remainder"} & state[run.module.net[1].weight].keys()
    means = _epoch_means(run.module.losses)
    assert means[-1] < 0.5 * means[0]


def test_bf16_mixed_with_fp32_weights_is_a_plain_adamw(trained):
    """fp32 weights: lowp updates plainly (no buffer, fp32 states), close to torch.optim.AdamW."""
    lowp_run, torch_run = trained["mixed-lowp"], trained["mixed-torch"]
    assert lowp_run.module.forwards == lowp_run.module.backwards == 2 * BATCHES
    for p in lowp_run.module.parameters():
        assert p.dtype == torch.float32
        state = lowp_run.optimizer().state[p]
        assert state["exp_avg"].dtype == torch.float32 and not {"compensation", "remainder"} & state.keys()
    for a, b in zip(lowp_run.module.parameters(), torch_run.module.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_16_mixed_gradscaler_plugin(trained):
    """fp16 autocast with a GradScaler: lowp takes ``grad_scale``/``found_inf`` from
    ``scaler.step`` (it unscales inside its step), the closure still runs once, and lowp's
    clip_grad_norm_ clips the unscaled norm to ``gradient_clip_val``."""
    run = trained["fp16"]
    assert len(run.module.clipped) == 2 * BATCHES and any(before > 0.5 for before, _ in run.module.clipped)
    for before, after in run.module.clipped:
        assert after == pytest.approx(min(before, 0.5), rel=1e-3)
    plugin = run.trainer.precision_plugin
    assert isinstance(plugin, MixedPrecision) and plugin.scaler is not None
    assert run.module.forwards == run.module.backwards == 2 * BATCHES
    steps = {int(s["step"]) for s in run.optimizer().state.values()}
    assert steps == {2 * BATCHES - run.optimizer().skipped_steps}
    # the gradients stayed scaled (by 2**9 or more) up to lowp's step, which unscaled them: the
    # first moment, an average of unscaled gradients clipped to norm 0.5, has a norm below 0.5
    assert plugin.scaler.get_scale() >= 2.0 ** 9
    first_moment = sum(float(s["exp_avg"].double().square().sum()) for s in run.optimizer().state.values())
    assert 0 < first_moment ** 0.5 <= 0.5 * (1 + 1e-3)
    means = _epoch_means(run.module.losses)
    assert means[-1] < means[0]


def test_step_runs_a_closure_once_and_returns_its_loss():
    model = cast_model(nn.Linear(4, 1), torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2)
    calls = []

    def closure():
        calls.append(1)
        opt.zero_grad()
        loss = model(torch.ones(2, 4, dtype=torch.bfloat16)).float().square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert len(calls) == 1 and isinstance(loss, torch.Tensor) and loss.requires_grad
    assert int(opt.state[model.weight]["step"]) == 1
