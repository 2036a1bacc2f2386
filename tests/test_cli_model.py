"""``--model`` of ``lowp doctor`` and ``lowp memory``: a transformers model type, a local config.json
or a folder holding one, ``module:factory``, a hub id read from the local Hugging Face cache only;
bad values exit with status 2 naming the option; long runs print progress on stderr."""
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lowp.cli import main
from lowp.progress import Progress
from lowp.model_spec import ModelSpecError, resolve

ROOT = Path(__file__).resolve().parents[1]
FACTORIES = "lowp_test_factories"
#: the tiny Llama of the tests: embeddings and head 2 x 128 x 64, per layer 4 x 64 x 64 / 2 (q, o; k, v with
#: 2 of 4 heads), 3 x 64 x 128 (MLP) and two norms, and the final norm
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2}
TINY_PARAMS = 2 * 128 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    """A folder holding the config.json of a tiny Llama (no weights)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tiny-llama"
    transformers.LlamaConfig(**TINY).save_pretrained(folder)
    assert (folder / "config.json").is_file()
    return folder


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache, used by huggingface_hub in this process."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def factories(tmp_path: Path, monkeypatch) -> str:
    """A module of model factories, good and bad, importable by name."""
    folder = tmp_path / "factories"
    folder.mkdir()
    (folder / f"{FACTORIES}.py").write_text(textwrap.dedent("""
        from torch import nn

        def tokens():
            return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50))

        def features():
            return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))

        def not_a_module():
            return {"weights": 1}

        def raises():
            raise RuntimeError("no weights here")

        def no_parameters():
            return nn.ReLU()

        def convolution():
            return nn.Conv1d(3, 4, 3)

        NOT_CALLABLE = 3

        class Zoo:
            @staticmethod
            def small():
                return features()
    """))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, FACTORIES, raising=False)
    yield FACTORIES
    sys.modules.pop(FACTORIES, None)


def _exit_2(argv: list[str], option: str, capsys) -> str:
    """Run ``lowp`` in this process, expect exit status 2 naming ``option``; the message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"lowp {argv[0]}: error: argument {option}: ") and "Traceback" not in err
    return last


# ---- what --model names --------------------------------------------------------------------------

def test_each_form_of_the_argument_is_recognised(tiny_llama, factories, hub_cache, tmp_path):
    assert resolve(" Demo ").kind == "demo"
    assert (resolve(f"{factories}:tokens").kind, resolve(f"{factories}:Zoo.small").target) == (
        "factory", f"{factories}:Zoo.small")
    pytest.importorskip("transformers")
    gpt2 = resolve("GPT2")
    assert (gpt2.kind, gpt2.target, gpt2.label) == ("type", "gpt2", "gpt2")
    config = str(tiny_llama / "config.json")
    assert (resolve(config).kind, resolve(config).target) == ("config", config)
    assert (resolve(str(tiny_llama)).kind, resolve(str(tiny_llama)).target) == ("config", config)
    with pytest.raises(ModelSpecError, match="holds no config.json"):
        resolve(str(tmp_path / "factories"))
    with pytest.raises(ModelSpecError, match="no such file or folder"):
        resolve(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ModelSpecError, match="not in the local cache"):
        resolve("someorg/not-cached-model")
    with pytest.raises(ModelSpecError, match=r"^expected 'demo', module:factory"):
        resolve("not a model!")


# ---- lowp doctor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["file", "folder"])
def test_doctor_runs_a_local_config_with_random_weights(form, tiny_llama, capsys):
    path = str(tiny_llama / "config.json" if form == "file" else tiny_llama)
    assert main(["doctor", "--model", path]) == 0
    captured = capsys.readouterr()
    first = captured.out.splitlines()[0]
    assert first.startswith(f"LlamaForCausalLM from {tiny_llama / 'config.json'}: {TINY_PARAMS:,} parameters")
    assert "4x8 random token ids in [0, 128)" in first and "checked against fp16" in first
    for row in ("model.embed_tokens ", "model.layers.1.mlp.down_proj ", "lm_head.weight "):
        assert row in captured.out
    assert "Recommendations (target fp16)" in captured.out and "loss scale of 2^" in captured.out
    assert "lowp doctor: building LlamaForCausalLM" in captured.err   # progress on stderr
    assert "lowp doctor: running forward and backward" in captured.err


def test_doctor_builds_fewer_layers_and_stays_quiet(tiny_llama, capsys):
    assert main(["doctor", "--model", str(tiny_llama), "--layers", "1", "--quiet", "--format", "bf16"]) == 0
    captured = capsys.readouterr()
    assert ", 1 layer: " in captured.out.splitlines()[0]
    assert "model.layers.0." in captured.out and "model.layers.1." not in captured.out
    assert captured.err == ""


def test_doctor_runs_module_factories(factories, capsys):
    assert main(["doctor", "--model", f"{factories}:tokens", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Sequential from {factories}:tokens(): 1,650 parameters, input 4x8 random token ids "
                          f"in [0, 50)")
    assert main(["doctor", "--model", f"{factories}:Zoo.small", "--scale", "1e5", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"Sequential from {factories}:Zoo.small(): 212 parameters, input 4x8x8 features, "
                          f"100000 x N(0, 1)")
    assert "overflows fp16" in out


@pytest.mark.parametrize("command", ["doctor", "memory"])
@pytest.mark.parametrize("factory, message", [
    ("not_a_module", "{m}:not_a_module() returned dict, expected a torch.nn.Module"),
    ("raises", "{m}:raises() raised RuntimeError: no weights here (expected it to return a torch.nn.Module"),
    ("missing", "'{m}' has no attribute 'missing' (expected module:factory naming a callable"),
    ("Zoo.large", "'{m}:Zoo' has no attribute 'large'"),
    ("NOT_CALLABLE", "'{m}:NOT_CALLABLE' is not callable (it is of type int;"),
    ("no_parameters", "ReLU from {m}:no_parameters() has no parameters"),
])
def test_bad_factories_exit_2_naming_the_model(command, factory, message, factories, capsys):
    last = _exit_2([command, "--model", f"{factories}:{factory}"], "--model", capsys)
    assert message.format(m=factories) in last


@pytest.mark.parametrize("command", ["doctor", "memory"])
def test_a_module_that_cannot_be_imported_is_named(command, capsys):
    last = _exit_2([command, "--model", "no_such_module_for_lowp:build"], "--model", capsys)
    assert "cannot import the module 'no_such_module_for_lowp'" in last and "PYTHONPATH" in last


def test_doctor_refuses_options_that_do_not_apply(tiny_llama, factories, capsys):
    assert "takes token ids" in _exit_2(["doctor", "--model", f"{factories}:tokens", "--scale", "3"], "--scale",
                                        capsys)
    assert "not to module:factory" in _exit_2(["doctor", "--model", f"{factories}:tokens", "--layers", "1"],
                                              "--layers", capsys)
    assert "not to the demo model" in _exit_2(["doctor", "--layers", "1"], "--layers", capsys)
    assert "first layer is Conv1d" in _exit_2(["doctor", "--model", f"{factories}:convolution"], "--model", capsys)
    assert "max_position_embeddings" in _exit_2(["doctor", "--model", str(tiny_llama), "--tokens", "4096"],
                                                "--tokens", capsys)


def test_doctor_refuses_a_batch_larger_than_the_memory(capsys):
    last = _exit_2(["doctor", "--batch", "4096", "--tokens", "65536"], "--tokens", capsys)
    assert "the demo model on 4096 x 65536 tokens needs about" in last and "GiB is available" in last


def test_doctor_refuses_a_model_larger_than_the_memory(tiny_llama, monkeypatch, capsys):
    import lowp.cli_args

    monkeypatch.setattr(lowp.cli_args, "available_memory", lambda: 2**16)   # 64 KiB; the model needs about 1 MiB
    last = _exit_2(["doctor", "--model", str(tiny_llama)], "--model", capsys)
    assert f"{TINY_PARAMS:,} parameters" in last and "GiB is available" in last and "--layers N" in last


def test_a_hub_id_is_read_from_the_local_cache_only(tiny_llama, hub_cache, capsys):
    snapshot = hub_cache / "models--someorg--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny_llama / "config.json").read_text())
    (hub_cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (hub_cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("0123abcd")
    assert main(["doctor", "--model", "someorg/tiny-llama", "--layers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("LlamaForCausalLM from someorg/tiny-llama (cached config.json), 1 layer: ")
    last = _exit_2(["memory", "--model", "someorg/other-model"], "--model", capsys)
    assert f"not in the local cache ({hub_cache})" in last


def test_a_hub_id_that_is_not_cached_is_refused_offline(tmp_path):
    """In a fresh process, with an empty cache: exit 2, saying that nothing is downloaded and what to
    pass instead; HF_HUB_OFFLINE is set before huggingface_hub is imported."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    env.pop("HF_HUB_OFFLINE", None)
    script = ("import sys; from lowp.cli import main\n"
              "try:\n    main(['doctor', '--model', 'someorg/not-downloaded'])\n"
              "except SystemExit as exc:\n"
              "    from huggingface_hub import constants\n"
              "    print('offline', constants.HF_HUB_OFFLINE); sys.exit(exc.code)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert run.returncode == 2, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("lowp doctor: error: argument --model: 'someorg/not-downloaded' is not 'demo'")
    for part in ("not in the local cache", "HF_HUB_OFFLINE=1", "hf download someorg/not-downloaded config.json",
                 "--model DIR/config.json"):
        assert part in last
    assert "offline True" in run.stdout


# ---- lowp memory ---------------------------------------------------------------------------------

@pytest.fixture
def few_configurations(monkeypatch):
    """Three lowp configurations, baselines not measured: the memory report in a few seconds."""
    import lowp.footprint.measure
    import lowp.footprint.report

    every = lowp.footprint.measure.lowp_configurations
    monkeypatch.setattr(lowp.footprint.measure, "lowp_configurations", lambda cls=None: every(cls)[:3])
    monkeypatch.setattr(lowp.footprint.report, "measure_baseline", lambda baseline: None)


def test_memory_measures_a_local_config_and_a_factory_with_progress(tiny_llama, factories, few_configurations,
                                                                    capsys):
    from lowp.footprint.baselines import BASELINES

    assert main(["memory", "--model", str(tiny_llama / "config.json"), "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["params"] == TINY_PARAMS and report["model"] == str(tiny_llama / "config.json")
    assert report["model_description"] == f"LlamaForCausalLM from {tiny_llama / 'config.json'}"
    total = 3 + len(BASELINES)
    for line in (f"lowp memory: building {tiny_llama / 'config.json'} on the meta device...",
                 f"lowp memory: measuring lowp AdamW bf16 nearest, bf16 states (1/{total})",
                 f"lowp memory: measuring FlashOptim FlashAdamW bf16 ({total}/{total})"):
        assert line in captured.err.splitlines()
    assert main(["memory", "--model", f"{factories}:tokens", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert f"1,650 parameters (Sequential from {factories}:tokens())" in captured.out and captured.err == ""


def test_memory_calls_factories_on_the_meta_device(factories):
    """The factory runs under torch.device("meta"): no weight memory for a model whose size is all
    that matters; one that fails there runs again plainly."""
    from lowp.model_spec import call_factory

    assert all(p.is_meta for p in call_factory(f"{factories}:tokens", meta=True).parameters())
    assert not any(p.is_meta for p in call_factory(f"{factories}:tokens").parameters())


# ---- progress ------------------------------------------------------------------------------------

def test_progress_steps_are_throttled_and_the_first_and_last_always_shown():
    out = io.StringIO()
    progress = Progress("lowp test", stream=out, every=60)
    progress.stage("starting")
    for i in range(1, 6):
        progress.step(i, 5, f"item {i}")
    assert out.getvalue().splitlines() == ["lowp test: starting...", "lowp test: item 1 (1/5)",
                                           "lowp test: item 5 (5/5)"]
    quiet = io.StringIO()
    silent = Progress("lowp test", stream=quiet, enabled=False)
    silent.stage("starting")
    silent.step(1, 1, "item")
    assert quiet.getvalue() == ""


def test_progress_repeats_a_long_stage_with_its_seconds():
    out = io.StringIO()
    with Progress("lowp test", stream=out, every=0.05) as progress:
        progress.stage("working")
        deadline = time.monotonic() + 30
        while " s]" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = out.getvalue().splitlines()
    assert lines[0] == "lowp test: working..."
    assert any(line.startswith("lowp test: working... [") and line.endswith(" s]") for line in lines[1:])
    after = out.getvalue()
    time.sleep(0.2)
    assert out.getvalue() == after   # the heartbeat stopped with the block


# ---- slow: whole commands in a subprocess ----------------------------------------------------------

def _lowp(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lowp", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)


@pytest.mark.slow
def test_memory_of_a_config_in_a_subprocess_reports_progress(tiny_llama):
    from lowp.footprint.baselines import BASELINES
    from lowp.footprint.measure import lowp_configurations
    from lowp.optim import SGD

    run = _lowp("memory", "--model", str(tiny_llama), "--optimizer", "sgd")
    assert run.returncode == 0, run.stderr
    assert f"SGD on {TINY_PARAMS:,} parameters (LlamaForCausalLM from {tiny_llama / 'config.json'})" in run.stdout
    total = len(lowp_configurations(SGD)) + len(BASELINES)
    progress = [line for line in run.stderr.splitlines() if line.startswith("lowp memory: measuring ")]
    assert progress[0] == f"lowp memory: measuring lowp SGD bf16 nearest, bf16 states (1/{total})"
    assert progress[-1] == f"lowp memory: measuring FlashOptim FlashAdamW bf16 ({total}/{total})"


@pytest.mark.slow
def test_doctor_builds_a_model_type_from_its_defaults(capsys):
    pytest.importorskip("transformers")
    assert main(["doctor", "--model", "gpt2", "--layers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("GPT2LMHeadModel(GPT2Config()), 1 layer: 46,473,216 parameters, input 4x8 random token "
                          "ids in [0, 50257)")
    assert "transformer.h.0.attn " in out and "transformer.h.1." not in out


@pytest.mark.slow
def test_the_lowp_script_imports_factories_from_the_current_folder(factories, tmp_path):
    """The ``lowp`` script (unlike ``python -m``) has no current folder on sys.path: --model adds it."""
    script = Path(sys.executable).parent / "lowp"
    if not script.is_file():
        pytest.skip("the lowp script is not installed beside this Python")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(script), "doctor", "--model", f"{factories}:features"], capture_output=True, text=True,
                         env=env, cwd=tmp_path / "factories", timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"Sequential from {factories}:features(): 212 parameters")
