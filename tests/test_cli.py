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
