"""``python -m verify`` / ``lce-verify``: run a campaign, replay failures, run the regression
corpus, run the mutation self-test. Exit codes: see `EXIT_PASS` ... below (docs/exit-codes.md)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

CORPUS_DIR = (
    Path(__file__).resolve().parent / "corpus"
)  # the regression corpus (verify.running.corpus)
# The exit codes of every command: this is their one definition (docs/exit-codes.md says the same).
EXIT_PASS = 0  # every check ran and passed
EXIT_FAIL = 1  # the implementation failed a check: failure artifacts written (a verdict on it)
EXIT_USAGE = 2  # bad arguments or input files (one line names which); nothing was judged
EXIT_INFRA = 3  # no check failed, but a worker died or hung: infrastructure only, re-run
EXIT_HARNESS = 4  # the harness itself raised (a bug in verify, traceback printed): no verdict
EXIT_SIGNAL = 128  # + the signal number (130 SIGINT, 143 SIGTERM): stopped, the report so far
ENV_VAR = "LCE_TOLERANCES"  # = verify.numerics.tolerances.ENV_VAR (not imported: torch loads late)


class UsageError(ValueError):
    """Bad arguments or input files; printed as ``lce-verify: error: ...`` with exit code 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the subcommand; returns the exit code (the console script exits)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    _interpret_triton_on_cpu()
    from verify.distributed.errors import PoolError

    try:
        with _tolerance_file(args.tolerances), _one_bug_per_search():
            return args.handler(args)
    except UsageError as exc:
        print(f"lce-verify {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PoolError as exc:  # a worker died or hung outside a campaign's own handling
        first = str(exc).splitlines()[0]
        print(f"lce-verify {args.command}: infrastructure error: {first}", file=sys.stderr)
        return EXIT_INFRA
    except Exception:
        traceback.print_exc()
        print(f"lce-verify {args.command}: internal error of the harness", file=sys.stderr)
        return EXIT_HARNESS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lce-verify",
        description="The lce verification harness: property campaigns, failure replay, "
        "the regression corpus and the mutation self-test.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser = functools.partial(sub.add_parser, parents=[_common_options()])  # type: ignore[method-assign]
    _add_run(sub)
    _add_replay(sub)
    _add_rehash(sub)
    _add_corpus(sub)
    _add_mutants(sub)
    return parser


def _common_options() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--tolerances",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"judge by this tolerance file (default: ${ENV_VAR}, else the shipped one)",
    )
    return common


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run a property campaign and write its report",
        description="Run a Hypothesis profile over backends x TP degrees within a time budget; "
        "write report.md, report.json and ratios.png into --out and one artifact per failure.",
    )
    p.add_argument("--profile", default="ci", help="settings profile: ci, nightly or dev (ci)")
    p.add_argument(
        "--backends",
        type=_names,
        default=(),
        help="comma-separated backends of the implementation (every one that runs here)",
    )
    p.add_argument("--tp", type=_ints, default=(1, 2, 4), help="comma-separated TP degrees (1,2,4)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="wall-clock budget in seconds, shared by the slices (default: DEFAULT_BUDGET_S of "
        "verify/running/config.py, what the ci profile's planned examples need on 2 cores)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("results/campaign"),
        help="report directory (results/campaign)",
    )
    p.add_argument(
        "--failures", type=Path, default=None, help="failure artifact directory (OUT/failures)"
    )
    p.add_argument(
        "--properties", type=_names, default=(), help="comma-separated property names (all)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo workers; cuda: NCCL, one process per GPU (cpu)",
    )
    p.add_argument("--seed", type=int, default=None, help="Hypothesis seed (the profile's)")
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="examples per backend x TP slice (the profile's)",
    )
    p.add_argument(
        "--dtypes",
        type=_names,
        default=(),
        help="comma-separated dtype keys to draw: fp32,bf16,fp16,fp32_bf16,fp64 (all)",
    )
    p.add_argument(
        "--searches",
        type=int,
        default=None,
        help="concurrent searches per TP=1 slice, each with its own worker (cuda: 3 per 4 cores, "
        "at most 12; cpu: 1)",
    )
    p.add_argument(
        "--example-deadline-s",
        type=float,
        default=None,
        help="seconds a case may take before it counts as hung, fixed (default: the profile's "
        "rule, the longer of 60 s and 10x the slowest example so far)",
    )
    p.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="leave out specs with this field value, e.g. regime=peaked (repeatable): a region "
        "with an open, reported finding",
    )
    p.add_argument("--mutant", default=None, help="plant this bug (self-test; see `mutants`)")
    _add_impl_option(p, "verify this implementation (default: lce, both backends)")
    p.set_defaults(handler=_cmd_run)


def _add_impl_option(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--impl",
        default=None,
        help=f"{what}: a built-in name (lce, lce-torch, lce-triton, torch, liger, liger-cute, "
        "liger-cute-flce, cce, cce-exact, cce-compile, quack, verl, verl-fp32; "
        "verify.adapters.registry.names()) or module:function (see docs/verify-your-kernel.md)",
    )


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="re-run saved failure artifacts",
        description="Re-run each artifact's properties on its spec (twice by default), print the "
        "verdicts and whether the runs were bit-identical. Exit 0 only if every replay passes.",
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="failure artifact(s)")
    _add_replay_options(p)
    p.add_argument("--times", type=int, default=2, help="runs per artifact (2)")
    p.add_argument(
        "--without-mutant", action="store_true", help="replay without the artifact's planted bug"
    )
    _add_impl_option(p, "replay through this implementation (default: the artifact's)")
    p.set_defaults(handler=_cmd_replay)


def _add_rehash(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "rehash",
        help="re-record artifacts' reference sha256 after a deliberate change to R",
        description="Recompute each artifact's float64 reference and rewrite its recorded sha256s "
        "where they differ (run it, and say why in the commit, only when R itself changed: a "
        "differing hash otherwise means the reference is not reproducible).",
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help="failure artifact(s)")
    p.set_defaults(handler=_cmd_rehash)


def _add_corpus(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "corpus",
        help="run the regression corpus",
        description="Replay every saved spec of the corpus on the code as it is (each must pass); "
        "for entries found with a planted bug, also check the bug is still caught.",
    )
    p.add_argument("--dir", type=Path, default=CORPUS_DIR, help="corpus directory (verify/corpus)")
    _add_replay_options(p)
    p.set_defaults(handler=_cmd_corpus)


def _add_mutants(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "mutants",
        help="the mutation self-test: which planted bugs the profile kills",
        description="Plant each known bug in turn, search with the profile, and print a table: "
        "killed or not, by which property, after how many examples, the shrunk spec.",
    )
    p.add_argument("--profile", default="ci", help="settings profile (ci)")
    p.add_argument("--backend", default="torch", help="backend to plant the bugs in (torch)")
    p.add_argument("--tp", type=_ints, default=(1, 2, 4), help="TP degrees to draw (1,2,4)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="worker device (cpu)")
    p.add_argument("--only", type=_names, default=(), help="comma-separated mutant names (all)")
    p.add_argument(
        "--no-shrink",
        action="store_true",
        help="landmark specs first and no shrinking: the fastest kill (the test suite's mode)",
    )
    p.add_argument(
        "--save-corpus",
        type=Path,
        default=None,
        help="save each kill's shrunk spec as an artifact here",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    p.set_defaults(handler=_cmd_mutants)


def _add_replay_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="run on this backend instead of the saved one")
    p.add_argument("--tp", type=int, default=None, help="run at this TP degree instead")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="worker device (cpu)")


def _cmd_run(args: argparse.Namespace) -> int:
    from verify.adapters import AdapterError
    from verify.results.report import headline
    from verify.running.campaign import plan, run_campaign
    from verify.running.config import DEFAULT_BUDGET_S, CampaignConfig

    budget_s = DEFAULT_BUDGET_S if args.budget_s is None else args.budget_s
    config = CampaignConfig(
        impl=args.impl or "lce", profile=args.profile, backends=args.backends, tp_sizes=args.tp,
        budget_s=budget_s, out_dir=args.out, failures_dir=args.failures,
        properties=args.properties, device=args.device, seed=args.seed, mutant=args.mutant,
        max_examples=args.max_examples, dtypes=args.dtypes, searches=args.searches,
        example_deadline_s=args.example_deadline_s, exclude=tuple(args.exclude),
    )  # fmt: skip
    try:
        config.validate()
        plan(config)
    except AdapterError as exc:
        raise UsageError(f"--impl: {exc}") from exc
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    result = run_campaign(config)
    doc = result.report
    counts = (
        f"{doc['examples']} examples in {doc['wall_s']:.0f} s, {len(doc['failures'])} failure(s), "
        f"{len(doc['errors'])} infrastructure error(s)"
    )
    if result.interrupted:
        print(f"{doc['title']}: INTERRUPTED by {result.interrupted} after {counts}; "
              f"report so far: {result.paths['markdown']}")  # fmt: skip
        return EXIT_SIGNAL + signal.Signals[result.interrupted].value
    print(f"{doc['title']}: {headline(doc)} - {counts} ({doc['examples_per_s']} examples/s)")
    for failure in doc["failures"]:
        print(f"  {failure['artifact']}: {failure['line']}")
    for error in doc["errors"]:
        print(f"  infrastructure error at {error['where']}: {error['message'].splitlines()[0]}")
    print(
        f"report: {result.paths['markdown']} (JSON {result.paths['json']}, "
        f"plot {result.paths['png'] or 'none: matplotlib is not installed'})"
    )
    return campaign_exit_code(doc)


def campaign_exit_code(doc: dict) -> int:
    """`EXIT_FAIL` when the implementation failed a check, else `EXIT_INFRA` when only
    infrastructure faulted, else `EXIT_PASS`: a verdict on the implementation outranks a harness
    error (`EXIT_HARNESS`: a property's own code raised), which outranks a fault of the machine."""
    if any(not failure.get("harness") for failure in doc["failures"]):
        return EXIT_FAIL
    if doc["failures"]:
        return EXIT_HARNESS
    return EXIT_INFRA if doc["errors"] else EXIT_PASS


def _cmd_replay(args: argparse.Namespace) -> int:
    from verify.results import artifacts
    from verify.running.replay import KEEP

    if args.times < 1:
        raise UsageError(f"--times must be >= 1, got {args.times}")
    loaded = _load_all(args.files, artifacts)
    mutant = None if args.without_mutant else KEEP
    too_big = _beyond_gpus(loaded, args)
    if too_big:
        raise UsageError(
            f"{too_big[0].path}: needs TP={args.tp or too_big[0].spec.tp} GPUs; "
            f"pass --tp 1 or --device cpu"
        )
    return _replay_all(loaded, args, lambda a: [(mutant, True)], args.times, annotate=False)


def _cmd_rehash(args: argparse.Namespace) -> int:
    from verify.results import artifacts

    for artifact in _load_all(args.files, artifacts):
        old, new = artifacts.rehash(artifact.path)
        change = "unchanged" if old == new else f"{(old or 'none')[:16]} -> {(new or 'none')[:16]}"
        print(f"{artifact.path}: reference sha256 {change}")
    return 0


def _cmd_corpus(args: argparse.Namespace) -> int:
    from verify.results import artifacts

    if not args.dir.is_dir():
        raise UsageError(f"--dir {args.dir}: not a directory")
    files = sorted(args.dir.glob("*.json"))
    if not files:
        raise UsageError(f"--dir {args.dir}: holds no *.json artifacts")
    loaded = _load_all(files, artifacts)
    from verify.running.corpus import plans

    skipped = _beyond_gpus(loaded, args)
    for artifact in skipped:
        print(f"{artifact.path.name}: skipped, TP={artifact.spec.tp} needs more GPUs than visible")
    loaded = [a for a in loaded if a not in skipped]
    if not loaded:
        print("no corpus entry fits the visible GPUs")
        return EXIT_PASS
    plan = functools.partial(plans, backend=args.backend)
    for artifact in loaded:
        mutant = artifact.record.get("mutant")
        if mutant and (mutant, False) not in plan(artifact):
            print(f"{artifact.path.name}: planted bug {mutant} does not reach backend "
                  f"{args.backend}: replayed without it only")  # fmt: skip
    return _replay_all(loaded, args, plan, times=1, annotate=True)


def _beyond_gpus(loaded: list, args: argparse.Namespace) -> list:
    """Artifacts whose TP degree exceeds the visible GPUs (none on ``--device cpu``)."""
    if args.device != "cuda":
        return []
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise UsageError("--device cuda but no GPU is visible; use --device cpu (gloo)")
    return [a for a in loaded if (args.tp or a.spec.tp) > gpus]


def _cmd_mutants(args: argparse.Namespace) -> int:
    import json

    from verify.execution.mutants import MUTANTS
    from verify.running.corpus import save_kill
    from verify.running.selftest import format_table, mutation_table

    names = list(args.only or MUTANTS)
    unknown = [n for n in names if n not in MUTANTS]
    if unknown:
        raise UsageError(f"--only: unknown mutant(s) {unknown}; known: {', '.join(MUTANTS)}")
    elsewhere = [n for n in names if not MUTANTS[n].applies_to(args.backend)]
    if elsewhere:
        print(f"not planted: {', '.join(elsewhere)} (do not reach backend {args.backend})")
    wider = [n for n in names if MUTANTS[n].min_tp > max(args.tp) and n not in elsewhere]
    if wider:
        print(f"not planted: {', '.join(wider)} (need a TP degree above --tp {max(args.tp)})")
    names = [n for n in names if n not in elsewhere and n not in wider]
    from verify.distributed.seam import open_pool

    with open_pool(max(args.tp), args.device) as pool:
        rows = []
        for name in names:  # one at a time, so a run stopped early still shows what it found
            rows += mutation_table(
                [name], pool=pool, profile=args.profile, backends=(args.backend,),
                shrink=not args.no_shrink,
            )  # fmt: skip
            print(format_table(rows[-1:]).splitlines()[1], flush=True)
        print(format_table(rows))
        for row in rows:
            if row.killed:
                print(f"  {row.mutant}: shrunk spec {row.shrunk_spec}")
            if args.save_corpus is not None:
                path = save_kill(row, pool, args.save_corpus, args.device)
                print(f"    saved {path}" if path else f"  {row.mutant}: nothing to save")
    if args.json is not None:
        args.json.write_text(json.dumps([row.to_json() for row in rows], indent=1) + "\n")
    return EXIT_PASS if all(row.counts for row in rows) else EXIT_FAIL  # a crash is no kill


def _replay_all(loaded, args, plans: Callable, times: int, annotate: bool) -> int:
    """Replay each artifact under each ``(mutant, must_pass)`` plan on worker processes; print one
    block per replay (``annotate``: mark outcomes other than the expected one). 0 when all went
    as expected."""
    from verify.adapters import AdapterError
    from verify.distributed.seam import open_pool
    from verify.running.replay import replay, summary_lines

    for artifact in loaded:
        _check_override(artifact, args)
    impl = getattr(args, "impl", None)
    tps = [args.tp or a.spec.tp for a in loaded]
    ok, runs, unexpected = True, 0, 0
    with open_pool(max(tps), args.device) as pool:
        for artifact in loaded:
            for mutant, must_pass in plans(artifact):
                try:
                    result = replay(
                        artifact, backend=args.backend, tp=args.tp, pool=pool, mutant=mutant,
                        times=times, adapter=impl,
                    )  # fmt: skip
                except AdapterError as exc:
                    raise UsageError(f"{artifact.path}: {exc}") from exc
                good = result.passed == must_pass and result.identical and result.reproducible
                if not must_pass and annotate:  # a corpus entry's planted bug: its own failure
                    good &= result.same_failure
                ok &= good
                runs, unexpected = runs + 1, unexpected + (not good)
                for line in summary_lines(result, must_pass if annotate else None):
                    print(line)
    verdict = "as expected" if ok else f"{unexpected} not as expected"
    print(f"{len(loaded)} artifact(s), {runs} replay(s): {verdict}")
    return EXIT_PASS if ok else EXIT_FAIL


def _check_override(artifact, args: argparse.Namespace) -> None:
    from verify.cases.spec import SpecError

    changes = {k: v for k, v in (("backend", args.backend), ("tp", args.tp)) if v is not None}
    try:
        artifact.spec.with_(**changes)
    except SpecError as exc:
        raise UsageError(f"{artifact.path}: cannot replay with {changes}: {exc}") from exc


def _load_all(files: Sequence[Path], artifacts) -> list:
    try:
        return [artifacts.load(path) for path in files]
    except artifacts.ArtifactError as exc:
        raise UsageError(str(exc)) from exc


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected a comma-separated list of names")
    return names


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,2,4, got {text!r}") from None


@contextlib.contextmanager
def _tolerance_file(path: Path | None) -> Iterator[None]:
    """Validate the tolerance file every verdict will use (``path``, else the default) before
    anything runs; ``path`` is exported as ``$LCE_TOLERANCES`` so worker processes use it too
    (the previous value is restored afterwards: main() also runs inside pytest)."""
    from verify.numerics.tolerances import ToleranceFileError, load

    previous = os.environ.get(ENV_VAR)
    if path is not None:
        os.environ[ENV_VAR] = str(path.resolve())
    try:
        try:
            load()
        except ToleranceFileError as exc:
            raise UsageError(str(exc)) from None
        yield
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous


@contextlib.contextmanager
def _one_bug_per_search() -> Iterator[None]:
    """Shrink and report one failure per search: the engine's profiles inherit the default
    settings, and with several distinct bugs Hypothesis would shrink each and raise a group.
    The previous default profile is restored afterwards (main() also runs inside pytest)."""
    from hypothesis import settings

    previous = settings.get_current_profile_name()
    settings.register_profile("lce-verify-cli", report_multiple_bugs=False)
    settings.load_profile("lce-verify-cli")
    try:
        yield
    finally:
        settings.load_profile(previous)


def _interpret_triton_on_cpu() -> None:
    """Without a GPU the Triton backend runs in its interpreter (set before triton is imported;
    worker processes inherit it)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
