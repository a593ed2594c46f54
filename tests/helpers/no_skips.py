"""Pytest plugin: a skipped test fails the run.

Every test must run on a fresh clone: the files tests need ship in `tests/fixtures/`, and
the test extra installs every dependency, so a skip can only mean something is missing
(the way 70 tests once skipped silently without a tokenizer outside the repository).
"""

from __future__ import annotations

import pytest


def _skipped(config: pytest.Config) -> list:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return [] if reporter is None else reporter.stats.get("skipped", [])


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = _skipped(config)
    if skipped:
        terminalreporter.write_line(
            f"error: {len(skipped)} test(s) skipped; every test must run "
            "(ship missing files in tests/fixtures/, add missing packages to the test extra)",
            red=True, bold=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    if _skipped(session.config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
