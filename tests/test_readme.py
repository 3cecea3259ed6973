"""The README starts with the two set-up commands, and CI runs exactly the README's test command."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("```bash")
    end = lines.index("```", start + 1)
    return [ln for ln in lines[start + 1:end] if ln.strip() and not ln.startswith("#")]


def test_readme_starts_with_demo_and_test_commands():
    demo, tests = readme_commands()
    assert "moe-compile train" in demo and "torch==2.13.0" in demo
    assert "pytest" in tests and '".[test]"' in tests


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci
