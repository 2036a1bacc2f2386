"""Every output path of the ``lowp`` subcommands that exists must be a regular file (or, for
``--out``, a folder): a device, named pipe, socket, folder or symbolic link is refused with exit
status 2 and a message naming the option, and is left exactly as it was. The atomic writes
replace the target with ``os.replace``, which would otherwise turn ``/dev/null`` into a file.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from lowp.cli import main

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")

#: small runs of each command, so that a check that let a bad path through would still finish
NORM_CHECK = ["norm-check", "--rows", "4", "--n-long", "2", "--formats", "fp16", "--methods", "naive"]
AUDIT = ["audit", "--kinds", "unary", "--ops", "exp", "--formats", "fp16", "--methods", "native", "--no-exhaustive",
         "--no-progress"]
REDUCE_SIM = ["reduce-sim", "--only", "premultiply", "--elements", "16", "--no-plots"]
DEMO = ["demo", "--steps", "1", "--modes", "fp32", "--jobs", "1", "--batch-size", "1", "--max-bytes", "4096"]


def _snapshot(path: Path) -> tuple:
    """What must not change: the lstat kind and identity, the link target, a file's bytes, a folder's entries."""
    st = os.lstat(path)
    kind = stat.S_IFMT(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        return kind, st.st_ino, os.readlink(path), _snapshot(path.resolve()) if path.exists() else None
    if stat.S_ISREG(st.st_mode):
        return kind, st.st_ino, path.read_bytes()
    if stat.S_ISDIR(st.st_mode):
        return kind, st.st_ino, sorted(os.listdir(path))
    return kind, st.st_ino, st.st_rdev


def _targets(tmp_path: Path) -> dict[str, Path]:
    """A named pipe, a symbolic link to a regular file, a folder and a link to a missing file."""
    (tmp_path / "real.txt").write_text("keep me\n")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "real.txt")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing.txt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "inside.txt").write_text("x")
    return {"fifo": tmp_path / "fifo", "link": tmp_path / "link", "dangling": tmp_path / "dangling",
            "folder": tmp_path / "folder"}


def _lowp(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # a timeout: a command that opened the named pipe for writing would block for ever
    return subprocess.run([sys.executable, "-m", "lowp", *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _assert_refused(result: subprocess.CompletedProcess, command: str, option: str, what: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lowp {command}: error: argument {option}:"), last
    assert what in last, last


# ---- in a subprocess, as a user runs it ----------------------------------------------------------

@pytest.mark.parametrize("option", ["--csv", "--markdown"])
@pytest.mark.parametrize("target,what", [("fifo", "named pipe"), ("link", "symbolic link"), ("folder", "folder")])
def test_norm_check_refuses_a_non_regular_output_file(option, target, what, tmp_path):
    path = _targets(tmp_path)[target]
    before = _snapshot(path)
    result = _lowp(*NORM_CHECK, option, str(path), cwd=tmp_path)
    _assert_refused(result, "norm-check", option, what)
    assert str(path) in result.stderr
    assert _snapshot(path) == before


def test_symbolic_link_message_names_where_it_points(tmp_path):
    path = _targets(tmp_path)["link"]
    result = _lowp(*NORM_CHECK, "--csv", str(path), cwd=tmp_path)
    _assert_refused(result, "norm-check", "--csv", "symbolic link")
    assert str(tmp_path / "real.txt") in result.stderr
    assert (tmp_path / "real.txt").read_text() == "keep me\n"


@pytest.mark.skipif(getattr(os, "geteuid", lambda: -1)() != 0 or not os.path.exists("/dev/null"),
                    reason="the campaign's case: root only")
@pytest.mark.parametrize("argv,option", [(NORM_CHECK + ["--csv"], "--csv"), (NORM_CHECK + ["--markdown"], "--markdown"),
                                         (AUDIT + ["--out"], "--out"), (REDUCE_SIM + ["--out"], "--out")])
def test_dev_null_stays_a_character_device(argv, option, tmp_path):
    before = os.stat("/dev/null")
    assert stat.S_ISCHR(before.st_mode)
    result = _lowp(*argv, "/dev/null", cwd=tmp_path)
    _assert_refused(result, argv[0], option, "character device")
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino


@pytest.mark.parametrize("argv,target,what", [(AUDIT, "fifo", "named pipe"), (REDUCE_SIM, "link", "symbolic link"),
                                              (DEMO, "dangling", "symbolic link")],
                         ids=lambda a: a[0] if isinstance(a, list) else a)
def test_output_folder_must_be_a_folder(argv, target, what, tmp_path):
    path = _targets(tmp_path)[target]
    before = _snapshot(path)
    result = _lowp(*argv, "--out", str(path), cwd=tmp_path)
    _assert_refused(result, argv[0], "--out", what)
    assert _snapshot(path) == before


@pytest.mark.parametrize("argv,name", [(AUDIT, "audit.md"), (REDUCE_SIM, "premultiply.csv"), (DEMO, "demo.csv")],
                         ids=lambda a: a[0] if isinstance(a, list) else a)
def test_a_file_of_the_output_folder_that_is_not_regular_is_refused(argv, name, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / name)
    before = _snapshot(out / name)
    result = _lowp(*argv, "--out", str(out), cwd=tmp_path)
    _assert_refused(result, argv[0], "--out", "named pipe")
    assert name in result.stderr.splitlines()[-1]
    assert _snapshot(out / name) == before and os.listdir(out) == [name]


# ---- in-process: the rest of the combinations ----------------------------------------------------

@pytest.mark.parametrize("argv", [AUDIT, REDUCE_SIM, DEMO], ids=lambda a: a[0])
@pytest.mark.parametrize("target,what", [("fifo", "named pipe"), ("link", "symbolic link"),
                                         ("dangling", "symbolic link")])
def test_every_output_folder_option_refuses_what_is_not_a_folder(argv, target, what, tmp_path, capsys):
    path = _targets(tmp_path)[target]
    before = _snapshot(path)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(path)])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exc.value.code == 2 and last.startswith(f"lowp {argv[0]}: error: argument --out:") and what in last
    assert _snapshot(path) == before


@pytest.mark.parametrize("target,what", [("dangling", "symbolic link")])
@pytest.mark.parametrize("option", ["--csv", "--markdown"])
def test_norm_check_refuses_a_dangling_link(option, target, what, tmp_path, capsys):
    path = _targets(tmp_path)[target]
    with pytest.raises(SystemExit) as exc:
        main([*NORM_CHECK, option, str(path)])
    assert exc.value.code == 2 and f"argument {option}:" in capsys.readouterr().err
    assert os.path.islink(path) and not (tmp_path / "missing.txt").exists()


@pytest.mark.parametrize("argv,name", [(AUDIT, "audit.csv"), (REDUCE_SIM, "premultiply.csv"), (DEMO, "demo_loss.png")],
                         ids=lambda a: a[0] if isinstance(a, list) else a)
@pytest.mark.parametrize("kind", ["link", "folder"])
def test_output_folder_entries_that_are_links_or_folders_are_refused(argv, name, kind, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "elsewhere").write_text("keep\n")
    if kind == "link":
        (out / name).symlink_to(tmp_path / "elsewhere")
    else:
        (out / name).mkdir()
    before = _snapshot(out / name)
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --out:" in err and name in err
    assert _snapshot(out / name) == before and (tmp_path / "elsewhere").read_text() == "keep\n"


def test_output_folder_may_be_a_symbolic_link_to_a_folder(tmp_path, capsys):
    """--out through a link to a folder writes into that folder; the link stays a link."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    assert main([*REDUCE_SIM, "--out", str(tmp_path / "out")]) == 0
    assert os.path.islink(tmp_path / "out") and os.listdir(real) == ["premultiply.csv"]
    assert sorted(os.listdir(tmp_path)) == ["out", "real"]  # no staging folder left behind
    capsys.readouterr()


def test_regular_output_files_are_still_replaced(tmp_path, capsys):
    csv, md = tmp_path / "t.csv", tmp_path / "t.md"
    csv.write_text("old\n")
    md.write_text("old\n")
    assert main([*NORM_CHECK, "--csv", str(csv), "--markdown", str(md)]) == 0
    assert csv.read_text().startswith("method,") and md.read_text().startswith("| method")
    capsys.readouterr()


# ---- at write time: the path changed after parsing -----------------------------------------------

def test_output_swapped_for_a_named_pipe_after_parsing_is_not_replaced(tmp_path, monkeypatch, capsys):
    """The check before ``os.replace``: norm-check parses a regular --csv path, which becomes a
    named pipe while the table is computed; the command fails (exit 1) naming the path, and the
    pipe is left alone with no temporary file beside it."""
    import lowp.commands.norm_check as norm_check

    path = tmp_path / "table.csv"
    path.write_text("old\n")

    def measure_then_swap(specs, methods, args):
        path.unlink()
        os.mkfifo(path)
        return [["naive", "fp16", "fp16", "pairs", 4, 0.5, 100.0, 100.0, 0, 0]]

    monkeypatch.setattr(norm_check, "_measure", measure_then_swap)
    assert main([*NORM_CHECK, "--csv", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("lowp norm-check: error:")
    assert str(path) in err and "named pipe" in err and "Traceback" not in err
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(tmp_path) == ["table.csv"]
