"""pytest plugin: verify an implementation from a user's own test suite.

Enable it with ``-p verify.pytest_plugin`` or ``pytest_plugins = ["verify.pytest_plugin"]`` in the
root conftest.py. Options: ``--lce-impl`` (a built-in name or ``module:function``),
``--lce-profile``, ``--lce-minutes``, ``--lce-max-examples``, ``--lce-tp``, ``--lce-failures``.
Fixtures: ``lce_impl`` (the selected `Adapter`) and ``lce_verify`` (a campaign of it, the same as
``lce-verify run --impl``: its cases run in worker processes, so a crash or a hang is a finding;
the test fails with one line per failure and its artifact). The terminal summary lists what each
run did not test.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # torch, lce and hypothesis load only when a fixture is used
    from verify.adapters import Adapter
    from verify.running.campaign import CampaignResult

_RESULTS = pytest.StashKey[list["CampaignResult"]]()
# The budget of an lce_verify call without --lce-minutes: the ci profile's examples fit in it.
DEFAULT_MINUTES = 2.0


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
        "--lce-minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help=f"time budget of each lce_verify call ({DEFAULT_MINUTES:g})",
    )
    group.addoption(
        "--lce-max-examples", type=int, default=None, help="examples per slice (profile's)"
    )
    group.addoption("--lce-tp", default="1", help="comma-separated TP degrees (1)")
    group.addoption(
        "--lce-failures",
        default=None,
        help="directory for the report and failure artifacts (default: the test's tmp_path)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = []


@pytest.fixture
def lce_impl(request: pytest.FixtureRequest) -> Adapter:
    """The `Adapter` named by ``--lce-impl`` (the test is skipped when it is not given)."""
    from verify.adapters import resolve

    ref = request.config.getoption("--lce-impl")
    if ref is None:
        pytest.skip("no implementation selected: pass --lce-impl NAME or module:function")
    return resolve(ref)


@pytest.fixture
def lce_verify(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., CampaignResult]:
    """``lce_verify(impl=None, **campaign_options) -> CampaignResult``: a campaign of ``impl``
    (default: ``--lce-impl``; options are `CampaignConfig` fields) that fails the test on any
    failure or infrastructure error, naming each failure and its artifact."""
    from verify.running.campaign import run_campaign
    from verify.running.config import CampaignConfig

    config = request.config

    def verify(impl: str | None = None, **options: Any) -> CampaignResult:
        chosen = impl if impl is not None else config.getoption("--lce-impl")
        if chosen is None:
            pytest.skip("no implementation selected: pass --lce-impl or lce_verify(impl)")
        out = Path(config.getoption("--lce-failures") or tmp_path)
        options.setdefault("profile", config.getoption("--lce-profile"))
        options.setdefault("budget_s", 60.0 * config.getoption("--lce-minutes"))
        options.setdefault("max_examples", config.getoption("--lce-max-examples"))
        options.setdefault(
            "tp_sizes", tuple(int(t) for t in config.getoption("--lce-tp").split(","))
        )
        options.setdefault("out_dir", out)
        result = run_campaign(CampaignConfig(impl=chosen, **options))
        config.stash[_RESULTS].append(result)
        if not result.passed:
            pytest.fail("\n".join(failure_lines(result.report)), pytrace=False)
        return result

    return verify


def failure_lines(doc: dict[str, Any]) -> list[str]:
    """One line per failure (with its artifact) and per infrastructure error of a report."""
    lines = [f"{doc['title']}: {doc['outcome']} (report {doc.get('out_dir', '')})"]
    lines += [f"{f['line']} artifact={f['artifact']}" for f in doc["failures"]]
    lines += [f"infrastructure error at {e['where']}: {e['message']}" for e in doc["errors"]]
    return lines


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section("lce verify")
    for result in results:
        doc = result.report
        terminalreporter.write_line(
            f"{doc['implementation']['name']}: {doc['outcome']}, {len(doc['properties'])} "
            f"properties, {doc['examples']} examples ({doc['profile']})"
        )
        for gap in doc["not_tested"]:
            terminalreporter.write_line(f"  not tested: {gap['what']}: {gap['reason']}")
