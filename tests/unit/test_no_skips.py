"""The suite's no-skip rule: a run with a skipped test exits non-zero (CI fails)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ["-p", "tests.helpers.no_skips", "-p", "no:cacheprovider"]


@pytest.fixture(autouse=True)
def _plugin_importable(monkeypatch):
    """The subprocess runs in a temporary directory: let it import `tests.helpers`."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))


def test_a_skipped_test_fails_the_run(pytester: pytest.Pytester):
    pytester.makepyfile("""
        import pytest

        def test_runs():
            pass

        def test_needs_a_missing_fixture():
            pytest.skip("Qwen3 tokenizer fixture missing")
    """)
    result = pytester.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*error: 1 test(s) skipped*", "*1 passed, 1 skipped*"])


def test_a_run_without_skips_passes(pytester: pytest.Pytester):
    pytester.makepyfile("def test_runs():\n    pass\n")
    assert pytester.runpytest_subprocess(*PLUGIN).ret == pytest.ExitCode.OK


def test_a_failing_run_keeps_its_status(pytester: pytest.Pytester):
    pytester.makepyfile("def test_fails():\n    assert False\n")
    assert pytester.runpytest_subprocess(*PLUGIN).ret == pytest.ExitCode.TESTS_FAILED
