"""`tier-bench summary --plot`: a saved `--json` summary (tests/data/tier_bench_summary.json, from
`tier-bench summary --quick --json`) drawn by tier-bench-plot into a PNG; without matplotlib, one
line naming `pip install matplotlib` and a non-zero exit, no traceback."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAVED = ROOT / "tests" / "data" / "tier_bench_summary.json"


def tier_bench():
    exe = os.environ.get("TIER_BENCH") or str(ROOT / "build" / "bin" / "tier-bench")
    if not os.path.exists(exe):
        pytest.fail(f"tier-bench not found at {exe}: set TIER_BENCH (scripts/test.sh does)", pytrace=False)
    return exe


def summary(*args, env=None):
    # The helper runs under this interpreter (the one whose packages the test checks).
    e = dict(os.environ, TIER_BENCH_PYTHON=sys.executable, **(env or {}))
    return subprocess.run([tier_bench(), "summary", *map(str, args)], capture_output=True, text=True, env=e,
                          timeout=120)


def test_saved_summary_is_drawn_to_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "links.png"
    r = summary("--from", SAVED, "--plot", out)
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert f"wrote {out}" in r.stdout


def test_without_matplotlib_one_line_names_the_install(tmp_path):
    # A matplotlib that cannot be imported, first on the path.
    fake = tmp_path / "site" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('not here')\n")
    r = summary("--from", SAVED, "--plot", tmp_path / "links.png", env={"PYTHONPATH": str(tmp_path / "site")})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "pip install matplotlib" in lines[0], r.stderr
    assert not (tmp_path / "links.png").exists()


def test_saved_summary_prints_as_a_table_and_bad_input_is_named(tmp_path):
    r = summary("--from", SAVED)
    assert r.returncode == 0 and "GB/s" in r.stdout, r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = summary("--from", bad, "--plot", tmp_path / "x.png")
    assert r.returncode == 2 and "not the JSON array" in r.stderr
