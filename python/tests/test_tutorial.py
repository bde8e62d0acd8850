"""examples/tutorial.py prints the seeds' numbers."""

import os
import re
import subprocess
import sys

import pytest

TUTORIAL = os.path.join(os.path.dirname(__file__), "..", "examples", "tutorial.py")

# The value of every printed array, in order: seed 001, then seed 003.
EXPECTED = [2, 8, 4, 4, 6, 6, 3, 11, -2, -7, 3, -3, -0.3, 3, 3.05]
UPDATES = ["3", "5", "7", "9", "5", "7", "9", "3"]


def run(*args):
    r = subprocess.run(
        [sys.executable, TUTORIAL, *args], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def check(out):
    # Each array prints as two rows of three equal numbers.
    rows = re.findall(r"^ ?\[+([-0-9. e]+)\]", out, re.M)
    values = [[float(x) for x in row.split()] for row in rows]
    assert all(len(set(v)) == 1 and len(v) == 3 for v in values), out
    firsts = [v[0] for v in values[::2]]
    assert firsts == pytest.approx(EXPECTED), out
    assert re.findall(r"^update on key: (\d+)$", out, re.M) == UPDATES
    assert "D[0] :  [" in out


def test_tutorial_numpy():
    out = run()
    check(out)
    assert "array([[-0.1, -0.1, -0.1]," in out


def test_tutorial_torch():
    pytest.importorskip("torch", reason="torch not installed")
    check(run("--torch"))
