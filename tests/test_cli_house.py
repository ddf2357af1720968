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

from conftest import write_sequence

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
