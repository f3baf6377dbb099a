"""pytest plugin: verify an implementation from a user's own test suite.

Enable it with ``-p verify.pytest_plugin`` or ``pytest_plugins = ["verify.pytest_plugin"]`` in the
root conftest.py. Options: ``--lce-impl`` (a built-in name or ``module:function``),
``--lce-profile``, ``--lce-minutes``, ``--lce-max-examples``, ``--lce-failures``. Fixtures:
``lce_impl`` (the selected `Adapter`) and ``lce_verify`` (run the engine on it; the test fails
with one line per failing verdict and its artifact). The terminal summary lists what each run
did not test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # torch, lce and hypothesis load only when a fixture is used
    from verify.adapters import Adapter, ImplReport

_REPORTS = pytest.StashKey[list["ImplReport"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lce-verify", "verify a linear cross-entropy implementation")
    group.addoption(
        "--lce-impl",
        default=None,
        help="implementation for the lce_impl/lce_verify fixtures: a built-in name "
        "(lce, lce-torch, lce-triton, torch, liger, cce, cce-exact) or module:function",
    )
    group.addoption("--lce-profile", default="ci", help="settings profile: ci, nightly or dev")
    group.addoption(
        "--lce-minutes", type=float, default=None, help="time budget of each lce_verify call"
    )
    group.addoption(
        "--lce-max-examples", type=int, default=None, help="examples per property (profile's)"
    )
    group.addoption(
        "--lce-failures",
        default=None,
        help="directory for failure artifacts (default: the test's tmp_path)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_REPORTS] = []


@pytest.fixture
def lce_impl(request: pytest.FixtureRequest) -> Adapter:
    """The `Adapter` named by ``--lce-impl`` (the test is skipped when it is not given)."""
    from verify.adapters import resolve

    ref = request.config.getoption("--lce-impl")
    if ref is None:
        pytest.skip("no implementation selected: pass --lce-impl NAME or module:function")
    return resolve(ref)


@pytest.fixture
def lce_verify(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., ImplReport]:
    """``lce_verify(impl=None, **check_impl_options) -> ImplReport``: searches ``impl`` (default:
    ``--lce-impl``) and fails the test on any failure, naming each verdict and its artifact."""
    from verify.adapters import check_impl

    config = request.config

    def verify(impl: str | Adapter | None = None, **options) -> ImplReport:
        chosen = impl if impl is not None else config.getoption("--lce-impl")
        if chosen is None:
            pytest.skip("no implementation selected: pass --lce-impl or lce_verify(impl)")
        options.setdefault("profile", config.getoption("--lce-profile"))
        options.setdefault("minutes", config.getoption("--lce-minutes"))
        options.setdefault("max_examples", config.getoption("--lce-max-examples"))
        options.setdefault("failures_dir", config.getoption("--lce-failures") or tmp_path)
        report = check_impl(chosen, **options)
        config.stash[_REPORTS].append(report)
        if not report.passed:
            pytest.fail("\n".join(report.failure_lines()), pytrace=False)
        return report

    return verify


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    reports = config.stash.get(_REPORTS, [])
    if not reports:
        return
    terminalreporter.section("lce verify")
    for report in reports:
        examples = sum(o.examples for o in report.outcomes)
        state = "passed" if report.passed else "FAILED"
        terminalreporter.write_line(
            f"{report.adapter.name}: {state}, {len(report.outcomes)} properties, "
            f"{examples} examples ({report.profile})"
        )
        for gap in report.untested:
            terminalreporter.write_line(f"  not tested: {gap.line()}")
