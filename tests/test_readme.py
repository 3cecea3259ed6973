"""The README starts with the two set-up commands, CI runs exactly the README's test command, and both
install through constraints.txt: exact pins of the tested environment, inside pyproject's ranges."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = "-c constraints.txt"


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    return [ln for ln in lines[start + 1:end] if ln.strip() and not ln.startswith("#")]


def constraint_pins() -> dict[str, str]:
    """name (normalised) → pinned version, from constraints.txt; every entry is an exact name==version."""
    pins = {}
    for ln in (ROOT / "constraints.txt").read_text().splitlines():
        ln = ln.split("#", 1)[0].strip()
        if not ln:
            continue
        m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", ln)
        assert m, f"constraints.txt: {ln!r} is not an exact name==version pin"
        pins[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return pins


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = readme_commands()
    assert "moe-compile train" in demo and "torch==2.13.0" in demo
    assert "pytest" in tests and '".[test]"' in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_both_commands_install_through_the_constraints_file():
    for cmd in readme_commands():
        installs = [part for part in cmd.split("&&") if "pip install" in part]
        assert installs and all(CONSTRAINTS in part for part in installs), cmd


def test_constraints_pin_the_tested_versions_inside_pyproject_ranges():
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    pins = constraint_pins()
    assert pins["torch"] == "2.13.0"  # the local CPU wheel; anything else may fetch a CUDA build
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    names = {re.sub(r"[-_.]+", "-", r.name).lower(): r for r in declared}
    assert "transformers" in names and names["transformers"].specifier, "pyproject must bound transformers"
    for name, req in names.items():
        assert name in pins, f"constraints.txt does not pin {req.name}, which pyproject requires"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}")
