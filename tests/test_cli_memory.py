"""``lowp memory``: the lowp rows are the bytes a real optimizer holds after a step, the baselines'
arithmetic follows their documented layouts, counts and names are parsed or refused clearly."""
import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowp.cli import main
from lowp.demo.model import CharLM
from lowp.footprint.measure import CODED_LAYOUTS, coded_state_dtype, layout_on, lowp_footprints
from lowp.footprint.models import meta_model, parse_count
from lowp.footprint.report import build_report, format_report
from lowp.optim import Adafactor, AdamW
from lowp.optim.codes import code_for
from lowp.optim.writeback import MODES

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GIB = 2**30


def _run_json(*args: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["memory", *args, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.fixture(scope="module")
def demo_report() -> dict:
    return _run_json("--model", "demo", "--grads")


def _real_step_bytes(dtype: torch.dtype, build) -> tuple[int, int, dict]:
    """(parameter count, bytes of params + grads + every tensor in opt.state, opt.state) after one
    real step on the demo model, summed here with t.nbytes (``build`` takes the reference backend:
    the bytes do not depend on it, and it compiles nothing)."""
    torch.manual_seed(1)
    model = CharLM().to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = build(model.parameters())
    opt.step()
    params = list(model.parameters())
    total = sum(p.nbytes + p.grad.nbytes for p in params)
    total += sum(t.nbytes for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    return sum(p.numel() for p in params), total, opt.state


def test_lowp_rows_are_the_bytes_of_a_real_adamw_after_a_step(demo_report):
    rows = [r for r in demo_report["rows"] if r["kind"] == "lowp"]
    # every mode with the weight dtypes it takes, default and fp32 states; fp32 once; bf16 in every mode
    # with each block-scaled layout
    low = sum(d in wb.dtypes for wb in MODES.values() for d in (torch.bfloat16, torch.float16))
    assert len(rows) == 2 * low + 1 + len(CODED_LAYOUTS) * len(MODES)
    assert {(r["weight_dtype"], r["mode"]) for r in rows} >= {("bf16", m) for m in MODES}
    assert not {("fp16", "exact"), ("fp16", "exact8")} & {(r["weight_dtype"], r["mode"]) for r in rows}
    assert {r["state_dtype"] for r in rows} >= set(CODED_LAYOUTS)
    for r in rows:
        dtype = DTYPES[r["weight_dtype"]]
        coded = r["state_dtype"] in CODED_LAYOUTS
        state_dtype = coded_state_dtype(AdamW, r["state_dtype"]) if coded else DTYPES[r["state_dtype"]]
        count, nbytes, state = _real_step_bytes(
            dtype, lambda ps, mode=r["mode"], state_dtype=state_dtype: AdamW(ps, mode=mode, state_dtype=state_dtype,
                                                                             backend="foreach"))
        assert demo_report["params"] == count
        assert r["total_bytes"] == nbytes, r["name"]
        assert math.isclose(r["bytes_per_param"], nbytes / count, rel_tol=1e-12)
        assert r["weights"] == dtype.itemsize and r["grads"] == dtype.itemsize
        moments = {k: {s[k].dtype for s in state.values()} for k in ("exp_avg", "exp_avg_sq")}
        if coded:   # codes from coded_min_numel (4096) elements, 16-bit states below
            sizes = {p.numel() >= 4096 for p in state}
            assert sizes == {True, False}, "the probe model has parameters of both kinds"
            assert moments == {k: {code_for(d).storage, dtype} for k, d in state_dtype.items()}, r["name"]
            assert all(s[k].dtype == (code_for(d).storage if p.numel() >= 4096 else dtype)
                       for p, s in state.items() for k, d in state_dtype.items()), r["name"]
        else:
            assert moments == {k: {state_dtype} for k in moments}, r["name"]
    by_name = {r["name"]: r for r in rows}
    # the layouts the table must show (weights + states + extra, gradients apart)
    assert by_name["lowp AdamW bf16 kahan, bf16 states"]["bytes_per_param"] - 2 == 8
    assert by_name["lowp AdamW bf16 stochastic, bf16 states"]["bytes_per_param"] - 2 == 6
    assert by_name["lowp AdamW bf16 exact, fp32 states"]["bytes_per_param"] - 2 == 12
    # weights and gradients, then per parameter of 4096 elements or more (coded_min_numel) one byte and
    # a half, and a bf16 scale per 64 elements of each state (the last block of a tensor padded); two
    # bf16 states for the smaller ones
    sizes = [p.numel() for p in CharLM().parameters()]
    states = sum(n + -(-n // 2) + 2 * 2 * -(-n // 64) if n >= 4096 else 2 * 2 * n for n in sizes)
    assert math.isclose(by_name["lowp AdamW bf16 stochastic, int8/uint4 states"]["bytes_per_param"] - 4,
                        states / sum(sizes), rel_tol=1e-12)
    assert by_name["lowp AdamW bf16 exact8, fp32 states"]["bytes_per_param"] - 2 == 11
    assert by_name["lowp AdamW bf16 exact8, bf16 states"]["bytes_per_param"] - 2 == 7
    assert by_name["lowp AdamW bf16 exact8, bf16 states"]["extra"] == 1


def test_rows_are_sorted_and_compared_with_torch_fp32_adamw(demo_report):
    rows = demo_report["rows"]
    per_param = [r["bytes_per_param"] for r in rows]
    assert per_param == sorted(per_param)
    reference = next(r for r in rows if r["name"] == "torch fp32 AdamW")["bytes_per_param"]
    assert reference == 16   # 4 weights + 8 moments + 4 gradients
    for r in rows:
        assert math.isclose(r["vs_torch_fp32_adamw"], r["bytes_per_param"] / reference, rel_tol=1e-12)
        assert r["total_bytes"] == round(r["bytes_per_param"] * demo_report["params"])
        assert math.isclose(r["total_gib"], r["bytes_per_param"] * demo_report["params"] / GIB, rel_tol=1e-12)
        assert str(r["source"]) in demo_report["sources"]


def test_baselines_follow_their_documented_layouts():
    count = 7 * 10**9
    report = build_report("adamw", count, with_grads=True)
    rows = {r["name"]: r for r in report["rows"] if r["kind"] == "baseline"}
    expected = {  # weights + states + extra (documented layouts), gradients
        "torch fp32 AdamW": (4 + 4 + 4, 4),
        "AMP bf16 autocast + fp32 AdamW": (4 + 8, 4),
        "bf16 weights + fp32 master + fp32 AdamW": (2 + 4 + 8, 2),
        "optimi AdamW bf16 kahan": (2 + 2 + 2 + 2, 2),
        "torchao AdamW8bit": (2 + 2 * (1 + 4 / 256), 2),
        "torchao AdamWFp8": (2 + 2 * (1 + 4 / 256), 2),
        "torchao AdamW4bit": (2 + 2 * (0.5 + 4 / 128), 2),
        "FlashOptim FlashAdamW bf16": (2 + 1 + 2 * (1 + 2 / 32), 2),
    }
    assert set(rows) == set(expected)
    for name, (memory, grads) in expected.items():
        r = rows[name]
        assert r["weights"] + r["states"] + r["extra"] == memory, name
        assert r["grads"] == grads and r["bytes_per_param"] == memory + grads
        assert r["total_bytes"] == round((memory + grads) * count)
        assert r["vs_torch_fp32_adamw"] == (memory + grads) / 16
        assert report["sources"][str(r["source"])]
    assert rows["FlashOptim FlashAdamW bf16"]["bytes_per_param"] - 2 == 5.125   # "about 5.1 bytes per parameter"


def test_block_scaled_rows_without_a_model_are_a_large_models_bytes():
    """Without a model the block-scaled rows count codes for every tensor of the probe (a large
    model's bytes: its tensors below coded_min_numel are a negligible share) and say so; the demo
    model's own rows (``demo_report``) keep its small tensors' states in bf16 instead."""
    report = build_report("adamw", 7 * 10**9)
    rows = {r["name"]: r for r in report["rows"]}
    sizes = [p.numel() for p in CharLM().parameters()]
    codes = sum(2 * n + 2 * 2 * -(-n // 64) for n in sizes) / sum(sizes)   # int8 + uint8, a bf16 scale per 64
    assert math.isclose(rows["lowp AdamW bf16 exact8, int8/uint8 states"]["bytes_per_param"], 2 + 1 + codes,
                        rel_tol=1e-12)
    assert any("codes for every tensor, a large model's bytes" in n for n in report["notes"]), report["notes"]


def test_measured_baselines_match_their_libraries(demo_report):
    rows = {r["name"]: r for r in demo_report["rows"]}
    count = demo_report["params"]
    # torch keeps one fp32 step counter tensor per parameter beside the 4 + 8 + 4 bytes
    n_tensors = len(list(CharLM().parameters()))
    torch_row = rows["torch fp32 AdamW"]
    assert round(torch_row["measured_bytes_per_param"] * count) == 16 * count + 4 * n_tensors
    pytest.importorskip("optimi")
    assert rows["optimi AdamW bf16 kahan"]["measured_bytes_per_param"] == 10


def test_torchao_states_are_measured_through_their_inner_tensors():
    """With torchao installed its states are measured; without it (CI: torchao is no test
    requirement, its CUDA extensions do not load on CPU torch) the rows keep the documented
    numbers and say that they are not measured."""
    from lowp.footprint.baselines import BASELINES, measure_baseline

    layout = {"AdamW8bit": (1, 256, 256 * 4), "AdamWFp8": (1, 256, 0), "AdamW4bit": (0.5, 128, 16 * 4)}
    try:
        import torchao.optim as torchao_optim
    except ImportError:
        for name in layout:
            assert measure_baseline(next(b for b in BASELINES if b.name == f"torchao {name}")) is None
        return
    params = list(CharLM().parameters())
    count = sum(p.numel() for p in params)
    for name, (code, block, qmap) in layout.items():
        assert hasattr(torchao_optim, name)
        expected = 0   # torchao/optim/adam.py: tensors of >= 4096 elements, a multiple of the block, are quantized
        for p in params:
            n = p.numel()
            moment = code * n + 4 * n // block + qmap if n >= 4096 and n % block == 0 else 2 * n
            expected += 2 * moment + 4   # two moments and an fp32 step counter
        baseline = next(b for b in BASELINES if b.name == f"torchao {name}")
        measured = measure_baseline(baseline)
        assert measured is not None
        assert round(measured.states * count) == expected, name


def test_the_meta_layout_of_factored_states_equals_a_real_step():
    # Adafactor's row/column factors: the meta-device layout equals a real step's bytes
    count, nbytes, _ = _real_step_bytes(torch.bfloat16, lambda ps: Adafactor(ps, mode="kahan", backend="foreach"))
    fp = layout_on(Adafactor, list(CharLM().parameters()), torch.bfloat16, "kahan", None)
    assert round(fp.total(True) * count) == nbytes


@pytest.mark.slow
def test_factored_states_are_computed_for_the_models_own_shapes():
    with torch.device("meta"):
        wide = torch.nn.Linear(4096, 1024, bias=False)
    rows = lowp_footprints("adafactor", target=wide)
    assert not any(r.per_element for r in rows)
    bf16 = next(r for r in rows if r.weight_dtype == torch.bfloat16 and r.state_dtype == torch.bfloat16)
    assert bf16.footprint.states == 2 * (1024 + 4096) / (1024 * 4096)   # one bf16 row and column factor


def test_sgd_without_momentum_has_no_states():
    report = build_report("sgd", 10**6)   # without gradients: torch fp32 AdamW is 12 bytes per parameter
    for r in report["rows"]:
        assert r["vs_torch_fp32_adamw"] == r["bytes_per_param"] / 12
        if r["kind"] == "lowp":
            assert r["states"] == 0
            weight = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[r["weight_dtype"]]
            buffer = MODES[r["mode"]].init_buffer(torch.zeros(1, dtype=weight)) if weight != torch.float32 else None
            assert r["extra"] == (0 if buffer is None else buffer.element_size())   # the mode's buffer per element
            assert r["bytes_per_param"] == r["weights"] + r["extra"]


@pytest.mark.parametrize("text, value", [("7e9", 7 * 10**9), ("125M", 125 * 10**6), ("1.3B", 1_300_000_000),
                                         ("1.3b", 1_300_000_000), ("350k", 350_000), ("2G", 2 * 10**9),
                                         ("1T", 10**12), ("124_439_808", 124_439_808), (" 12 ", 12), ("1e15", 10**15)])
def test_parameter_counts_parse(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize("text", ["", "abc", "-5", "0", "nan", "inf", "1.5", "1.2.3", "5X", "2e15", "B", "1,3B",
                                  "0.1K5"])
def test_bad_parameter_counts_name_the_argument(text, capsys):
    with pytest.raises(ValueError, match=r"^params: expected a whole parameter count"):
        parse_count(text)
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--params", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --params: expected a whole parameter count between 1 and 1e15" in err
    assert repr(text) in err


@pytest.mark.parametrize("argv, option", [
    (["--model", "no-such-model"], "--model"),
    (["--params", "7e9", "--model", "demo"], "--model"),
    (["--optimizer", "adamx"], "--optimizer"),
])
def test_bad_options_exit_with_status_2(argv, option, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["memory", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "Traceback" not in err


def test_hugging_face_models_are_built_from_their_config_without_download():
    pytest.importorskip("transformers")
    model, description = meta_model(" GPT2 ")   # any case, spaces around
    assert sum(p.numel() for p in model.parameters()) == 124_439_808   # GPT-2 small, tied embeddings once
    assert all(p.device.type == "meta" for p in model.parameters())
    assert description == "GPT2LMHeadModel(GPT2Config())"
    t5, description = meta_model("t5")   # an encoder-decoder: its sequence-to-sequence LM
    assert description == "T5ForConditionalGeneration(T5Config())"
    assert sum(p.numel() for p in t5.parameters()) == 60_506_624   # T5-small


def test_json_round_trips_and_renders_as_the_table(demo_report):
    assert json.loads(json.dumps(demo_report)) == demo_report
    assert demo_report["model"] == "demo" and demo_report["grads"] is True
    table = format_report(demo_report)
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("configuration"))
    body = lines[header + 2: header + 2 + len(demo_report["rows"])]
    assert [line.split("  ")[0].strip() for line in body] == [r["name"] for r in demo_report["rows"]]
    assert "vs torch fp32 AdamW" in lines[header]
    for key in demo_report["sources"]:
        assert f"[{key}] " in table


def _lowp_memory(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "lowp", "memory", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)


def test_command_line_refuses_a_bad_count_with_status_2():
    bad = _lowp_memory("--params", "12Q")
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines()[-1].startswith("lowp memory: error: argument --params:")
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_command_line_prints_the_table_with_status_0():
    ok = _lowp_memory("--params", "1.3B")
    assert ok.returncode == 0, ok.stderr
    assert "1,300,000,000 parameters" in ok.stdout
    row = next(line for line in ok.stdout.splitlines() if line.startswith("lowp AdamW bf16 kahan, bf16 states"))
    assert f"{8 * 1.3e9 / GIB:.4g}" in row and "0.667x" in row
