"""deployments.app.SERVE_ENV's traceback setting, checked in a fresh interpreter as Ray starts one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from deployments.app import SERVE_ENV

# Counts the ast.parse calls made while formatting a traceback whose source lines exist (a file).
SCRIPT = textwrap.dedent("""
    import ast, traceback
    calls = []
    parse = ast.parse
    ast.parse = lambda *a, **k: calls.append(1) or parse(*a, **k)
    def fail():
        return {}["a"]["b"]
    try:
        fail()
    except KeyError as exc:
        text = "".join(traceback.format_exception(exc))
    print(len(calls), "^" in text)
""")


def _run(tmp_path, extra_env: dict[str, str]) -> str:
    script = tmp_path / "tb.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONNODEBUGRANGES"} | extra_env
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.split()


def test_serving_processes_format_tracebacks_without_parsing(tmp_path):
    # Python 3.11's ast.parse races between threads (its recursion count is per interpreter):
    # a traceback formatted while another thread formats one could raise SystemError instead.
    calls, markers = _run(tmp_path, {})
    assert int(calls) > 0 and markers == "True"  # plain Python parses to draw its markers
    assert _run(tmp_path, SERVE_ENV) == ["0", "False"]
