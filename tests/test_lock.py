"""constraints.txt (the lock the README installs from) agrees with pyproject.toml, and the check notices
when an edit makes them disagree (on copies: the repository's files are never touched)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _lock_module():
    spec = importlib.util.spec_from_file_location("ci_lock", ROOT / ".ci" / "lock.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


lock = _lock_module()


@pytest.fixture
def copies(tmp_path) -> tuple[Path, Path]:
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path / "pyproject.toml", tmp_path / "constraints.txt"


def test_the_lock_matches_pyproject():
    assert lock.disagreements(ROOT / "pyproject.toml", ROOT / "constraints.txt") == []


def test_the_readme_commands_install_from_the_lock():
    commands = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("pip install torch")]
    assert len(commands) == 2
    for command in commands:
        steps = command.split(" && ")
        installs = [s for s in steps if s.startswith("pip install") and "torch==" not in s]
        assert installs and all("-c constraints.txt" in s for s in installs), command


def test_the_lock_leaves_torch_to_the_user():
    pinned = lock.pins((ROOT / "constraints.txt").read_text())
    assert "torch" not in pinned and not any(name.startswith("nvidia-") for name in pinned)
    assert "pytest" in pinned and "ray" in pinned  # a test extra and a base dependency


def test_a_new_dependency_is_caught(copies):
    pyproject, constraints = copies
    text = pyproject.read_text()
    pyproject.write_text(text.replace('"numpy",', '"numpy",\n    "tabulate>=0.9",', 1))
    problems = lock.disagreements(pyproject, constraints)
    assert "pyproject.toml's dependencies changed since the lock was made" in problems
    assert any(p.startswith("tabulate") and "no pin" in p for p in problems), problems


def test_a_pin_outside_the_range_is_caught(copies):
    pyproject, constraints = copies
    ray = lock.pins(constraints.read_text())["ray"]
    constraints.write_text(constraints.read_text().replace(f"ray=={ray}\n", "ray==2.0.0\n"))
    assert lock.disagreements(pyproject, constraints) == ["ray==2.0.0 is outside pyproject's range ray[serve]>=2.60"]


def test_the_command_line_check_fails_on_an_edited_copy(copies):
    """What .ci/run runs first: exit 1 and a message naming the fix."""
    pyproject, _ = copies
    (pyproject.parent / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "lock.py", pyproject.parent / ".ci" / "lock.py")
    check = [sys.executable, str(pyproject.parent / ".ci" / "lock.py"), "check"]
    assert subprocess.run(check, capture_output=True).returncode == 0
    pyproject.write_text(pyproject.read_text().replace('"pydantic>=2.5"', '"pydantic>=2.5,<2.6"'))
    failed = subprocess.run(check, capture_output=True, text=True)
    assert failed.returncode == 1
    assert "pydantic==" in failed.stderr and "python .ci/lock.py refresh" in failed.stderr
