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
