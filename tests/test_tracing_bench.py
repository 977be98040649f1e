"""The observability benchmark (benchmarks/observability.py) runs at a tiny size: both sides serve
the same tokens, and "on" exports one trace of three spans per request. Speed is not asserted."""

from __future__ import annotations

import json

from benchmarks.observability import main


def test_observability_benchmark_runs_both_sides(tmp_path, capsys):
    assert main(["--requests", "3", "--output-len", "4", "--slots", "2", "--rounds", "2", "--no-ray-metrics",
                 "--out-dir", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "observability.json").read_text())
    rows = results["rows"]
    assert sorted((r["mode"], r["round"]) for r in rows) == [("off", 1), ("off", 2), ("on", 1), ("on", 2)]
    assert {r["tokens"] for r in rows} == {3 * 4}
    assert results["spans_per_request"] == 3
    assert results["ratio_on_off"] > 0 and "on / off" in capsys.readouterr().out


def test_bad_sizes_are_refused_by_name(tmp_path, capsys):
    assert main(["--rounds", "0", "--out-dir", str(tmp_path)]) == 1
    assert "--rounds must be at least 1" in capsys.readouterr().err
