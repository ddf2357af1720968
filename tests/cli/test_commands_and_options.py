"""Defects of the command line and the toys found in review, each pinned by a test.

* peakprobe's own warnings (a skipped checkpoint folder, tau unknown, a shortened window) were
  hidden by default: now shown as one line each, also under -q;
* ``toy/plots.py`` switched matplotlib's backend at import;
* ``peakprobe toy peaked`` printed only "results in DIR (4 summary entries)": now the fitted
  exponents, their 90% intervals and the three-way verdict against 1/3 with its band (tested in
  test_toy_peaked.py, on the run it trains anyway).
"""

from __future__ import annotations

import subprocess
import sys

from helpers import write_sequence

from peakprobe.cli import main


def test_peakprobe_warnings_are_shown_as_one_line_also_under_quiet(tmp_path, capsys):
    write_sequence(tmp_path, steps=[0, 4])
    (tmp_path / "notes").mkdir()  # not a checkpoint: the index skips it with a warning
    assert main(["index", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("peakprobe: warning:")]
    assert len(lines) == 1 and "notes" in lines[0]
    assert main(["index", str(tmp_path), "-q"]) == 0
    assert capsys.readouterr().err.count("peakprobe: warning:") == 1


def test_importing_the_toy_plots_leaves_matplotlib_backend_alone():
    code = ("import matplotlib; matplotlib.use('svg'); import peakprobe.toy.plots; "
            "print(matplotlib.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().lower() == "svg"


def _help(*argv: str, capsys) -> str:
    assert main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def test_each_toy_subcommand_shows_only_its_own_options(capsys):
    own = {"peaked": {"--optimizer"}, "linear": {"--law"}, "planted": {"--task"}}
    for name, flags in own.items():
        text = _help("toy", name, capsys=capsys)
        others = set().union(*(f for n, f in own.items() if n != name))
        assert all(f in text for f in flags) and not any(f in text for f in others), name


def test_probe_takes_its_data_like_every_command(capsys):
    text = _help("probe", capsys=capsys)
    assert "--data" in text and "--layout" in text and "--text " not in text
    assert "evaluation windows (default 8)" in text


def test_no_sensitivity_is_a_deprecated_alias_said_once(tmp_path, capsys):
    from peakprobe.cli import build_parser

    args = build_parser().parse_args(["sweep", "x", "--out", "y", "--no-sensitivity"])
    assert args.attr__enabled is False
    assert build_parser().parse_args(["sweep", "x", "--out", "y", "--no-attribution"]).attr__enabled is False
    # a folder with no checkpoints: the run stops with one error, after one deprecation line
    code = main(["sweep", str(tmp_path), "--out", str(tmp_path / "run"), "--no-sensitivity",
                 "--no-sensitivity", "-q"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert [line for line in err if "warning" in line] == [
        "peakprobe: warning: --no-sensitivity is deprecated and will be removed; use --no-attribution"]
