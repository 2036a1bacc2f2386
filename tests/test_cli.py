import pytest
import subprocess
import sys

from lowp.cli import build_parser, command_modules, main


def test_every_command_module_registers():
    parser = build_parser()
    names = set(command_modules())
    assert "formats" in names
    for name in names:
        # each subcommand parses its own --help without error
        try:
            parser.parse_args([name, "--help"])
        except SystemExit as exc:
            assert exc.code == 0


def test_formats_table_lists_every_preset(capsys):
    from lowp.formats import PRESETS

    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "65504" in out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "lowp", "formats", "--csv"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0].startswith("name,bits")


def test_optim_speed_times_lowp_against_torch_fused(capsys):
    import pytest
    import torch

    from lowp.optim.kernels import native_available

    before = torch.get_num_threads()
    try:
        assert main(["optim-speed", "--size", "64K", "--rounds", "1", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    fused = "native" if native_available() else "compiled"
    assert f"picks backend '{fused}'" in out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "Mparams/s" not in line}
    for name in ("torch AdamW fused fp32", "lowp AdamW bf16 kahan foreach", f"lowp AdamW bf16 kahan {fused}"):
        assert name in rows
        assert float(rows[name].split()[-8]) > 0  # Mparams/s
    with pytest.raises(SystemExit) as exc:
        main(["optim-speed", "--size", "12"])
    assert exc.value.code == 2
    assert "--size" in capsys.readouterr().err


# ---- bad invocations: one line on stderr naming the option, exit status 2, no traceback -------------

BAD_INVOCATIONS = [
    (["formats", "--custom", "bogus"], "--custom"),
    (["formats", "--custom", "e9m60"], "--custom"),
    (["doctor", "--format", "fp64"], "--format"),
    (["doctor", "--format", "bogus"], "--format"),
    (["doctor", "--scale", "nan"], "--scale"),
    (["doctor", "--scale", "-1"], "--scale"),
    (["doctor", "--loss-factor", "inf"], "--loss-factor"),
    (["doctor", "--seed", "-1"], "--seed"),
    (["norm-check", "--formats", "bogus"], "--formats"),
    (["norm-check", "--formats", "bf16:fp16"], "--formats"),
    (["norm-check", "--formats", "fp4_e2m1"], "--formats"),
    (["norm-check", "--methods", "nope"], "--methods"),
    (["norm-check", "--methods", ","], "--methods"),
    (["norm-check", "--rows", "2"], "--rows"),
    (["norm-check", "--rows", "1e15"], "--rows"),
    (["norm-check", "--n-long", "1e9"], "--n-long"),
    (["norm-check", "--seed", "-3"], "--seed"),
    (["norm-check", "--csv", "{dir}"], "--csv"),
    (["norm-check", "--markdown", "{blocked}/n.md"], "--markdown"),
    (["audit", "--formats", "fp32"], "--formats"),
    (["audit", "--formats", "bogus"], "--formats"),
    (["audit", "--kinds", "x"], "--kinds"),
    (["audit", "--methods", "y"], "--methods"),
    (["audit", "--ops", "nope"], "--ops"),
    (["audit", "--points", "1"], "--points"),
    (["audit", "--kinds", "binary", "--points", "1e7"], "--points"),
    (["audit", "--kinds", "reductions", "--lengths", "10,1e15"], "--lengths"),
    (["audit", "--kinds", "unary", "--out", "{blocked}"], "--out"),
    (["audit", "--threads", "5000"], "--threads"),
    (["demo", "--modes", "bf16-kahn"], "--modes"),
    (["demo", "--steps", "0"], "--steps"),
    (["demo", "--steps", "1e12"], "--steps"),
    (["demo", "--jobs", "0"], "--jobs"),
    (["demo", "--jobs", "100000"], "--jobs"),
    (["demo", "--batch-size", "1e12"], "--batch-size"),
    (["demo", "--lr", "nan"], "--lr"),
    (["demo", "--lr", "-1"], "--lr"),
    (["demo", "--max-bytes", "10"], "--max-bytes"),
    (["demo", "--max-bytes", "1e15"], "--max-bytes"),
    (["demo", "--out", "{blocked}"], "--out"),
    (["demo", "--out", "{file}"], "--out"),
    (["optim-speed", "--size", "100G"], "--size"),
    (["optim-speed", "--size", "x"], "--size"),
    (["optim-speed", "--rounds", "0"], "--rounds"),
    (["optim-speed", "--rounds", "100000"], "--rounds"),
    (["optim-speed", "--threads", "100000"], "--threads"),
    (["reduce-sim", "--max-world-size", "1e6"], "--max-world-size"),
    (["reduce-sim", "--elements", "1e9"], "--elements"),
    (["reduce-sim", "--elements", "0"], "--elements"),
    (["reduce-sim", "--only", "bogus"], "--only"),
    (["reduce-sim", "--out", "{blocked}"], "--out"),
    (["doctor", "--seed", str(2**64)], "--seed"),
    (["doctor", "--seed", "1.5"], "--seed"),
    (["norm-check", "--seed", str(2**64)], "--seed"),
    (["norm-check", "--seed", "1e20"], "--seed"),
    (["demo", "--seed", str(2**64 - 1)], "--seed"),
    (["audit", "--ops", ""], "--ops"),
    (["audit", "--ops", " , ,"], "--ops"),
    (["audit", "--ops", "exp,nope"], "--ops"),
    (["audit", "--kinds", "unary", "--ops", "exp,add"], "--ops"),
]


@pytest.mark.parametrize("argv,option", BAD_INVOCATIONS, ids=[" ".join(a) for a, _ in BAD_INVOCATIONS])
def test_bad_invocations_exit_2_naming_the_option(argv, option, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    paths = {"dir": str(tmp_path), "file": str(tmp_path / "file"), "blocked": str(tmp_path / "file" / "sub")}
    with pytest.raises(SystemExit) as exc:
        main([a.format(**paths) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert option in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"lowp {argv[0]}: error: argument {option}")


def test_optim_speed_without_cuda_names_device(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    with pytest.raises(SystemExit) as exc:
        main(["optim-speed", "--device", "cuda"])
    assert exc.value.code == 2 and "--device" in capsys.readouterr().err


@pytest.mark.parametrize("argv,heavy", [
    (["demo", "--out", "{blocked}"], "lowp.demo.data.load_data"),
    (["audit", "--kinds", "unary", "--out", "{blocked}"], "lowp.audit.unary.audit_unary"),
    (["norm-check", "--csv", "{blocked}/n.csv"], "lowp.norms.check.score"),
    (["reduce-sim", "--out", "{blocked}"], "lowp.distributed.experiments.seed_grid"),
])
def test_unwritable_output_fails_before_any_work(argv, heavy, tmp_path, monkeypatch, capsys):
    import importlib

    module, name = heavy.rsplit(".", 1)

    def refuse(*args, **kwargs):
        raise AssertionError(f"{heavy} ran although the output cannot be written")

    monkeypatch.setattr(importlib.import_module(module), name, refuse)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as exc:
        main([a.format(blocked=str(tmp_path / "file" / "sub")) for a in argv])
    assert exc.value.code == 2 and "cannot write" in capsys.readouterr().err


def test_reduce_sim_interrupted_leaves_the_previous_outputs(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second section: the folder keeps the previous run's files, byte for byte,
    and gets none of this run's; no staging folder is left behind."""
    from lowp.distributed import experiments

    out = tmp_path / "rs"
    assert main(["reduce-sim", "--only", "premultiply", "--only", "fp16", "--elements", "16", "--no-plots",
                 "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"premultiply.csv", "fp16.csv"}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "fp16_table", interrupted)
    assert main(["reduce-sim", "--only", "premultiply", "--only", "fp16", "--elements", "32", "--no-plots",
                 "--out", str(out)]) == 130
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rs"]
    assert "interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("argv,option", [
    (["optim-speed"], "--size"),
    (["audit", "--kinds", "binary"], "--points"),
    (["audit", "--kinds", "reductions"], "--lengths"),
    (["norm-check"], "--n-long"),
    (["demo"], "--batch-size"),
    (["reduce-sim"], "--elements"),
])
def test_default_sizes_are_refused_when_memory_is_short(argv, option, monkeypatch, tmp_path, capsys):
    """The memory check compares each command's estimate with what is available now (1 MiB here)."""
    import lowp.cli_args

    monkeypatch.setattr(lowp.cli_args, "available_memory", lambda: 2**20)
    with pytest.raises(SystemExit) as exc:
        main(argv + (["--out", str(tmp_path)] if argv[0] in ("demo", "reduce-sim") else []))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {option}:" in err and "GiB is available" in err


def test_available_memory_is_positive_and_at_most_physical():
    import os

    from lowp.cli_args import available_memory

    assert 0 < available_memory() <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- --seed: exactly the 64-bit seeds each command can use ----------------------------------------

#: the largest seed per command: torch's generators and lowp's optimizers take [0, 2**64); demo
#: also seeds its batch generator with seed + 1
LARGEST_SEED = {"doctor": 2**64 - 1, "norm-check": 2**64 - 1, "demo": 2**64 - 2}


def _commands_with_seed() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sorted(name for name, p in sub.choices.items() if any("--seed" in a.option_strings for a in p._actions))


def test_every_command_with_a_seed_is_covered():
    assert _commands_with_seed() == sorted(LARGEST_SEED)


@pytest.mark.parametrize("command", sorted(LARGEST_SEED))
def test_seed_range_is_parsed_exactly(command, capsys):
    """The largest seed parses to itself (not rounded through a float); one more, or a negative
    seed, is a usage error that states the accepted range."""
    parser = build_parser()
    top = LARGEST_SEED[command]
    for seed in (0, 2**53 + 1, 2**63, top):
        assert parser.parse_args([command, "--seed", str(seed)]).seed == seed
    for bad in (top + 1, 2**64, -1):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([command, "--seed", str(bad)])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "Traceback" not in err
        assert f"argument --seed: expected an integer in [0, 2**64 - {2**64 - top}]" in err


def test_largest_seeds_run(tmp_path, capsys):
    """The boundary seeds reach torch's generators and lowp's optimizer without an error."""
    assert main(["doctor", "--seed", str(2**64 - 1)]) == 0
    assert main(["norm-check", "--seed", str(2**64 - 1), "--rows", "4", "--n-long", "2", "--formats", "fp16",
                 "--methods", "naive"]) == 0
    assert main(["demo", "--seed", str(2**64 - 2), "--steps", "1", "--modes", "fp32,bf16-stochastic", "--jobs", "1",
                 "--batch-size", "1", "--max-bytes", "4096", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "demo.csv").exists()
    capsys.readouterr()


def test_seed_2_to_the_63_in_a_subprocess():
    """The campaign's case: ``--seed 2**63`` and above ran into torch and ended in a traceback."""
    for seed, code in ((2**63, 0), (2**64, 2)):
        out = subprocess.run([sys.executable, "-m", "lowp", "doctor", "--seed", str(seed)], capture_output=True,
                             text=True)
        assert out.returncode == code and "Traceback" not in out.stderr, out.stderr


# ---- --ops ------------------------------------------------------------------------------------------

def test_audit_ops_must_name_an_op(capsys):
    for value in ("", " ", ",,"):
        with pytest.raises(SystemExit) as exc:
            main(["audit", "--ops", value])
        err = capsys.readouterr().err
        assert exc.value.code == 2
        assert err.strip().splitlines()[-1] == (f"lowp audit: error: argument --ops: expected comma-separated op "
                                                f"names (leave --ops out to audit every op), got {value!r}")
