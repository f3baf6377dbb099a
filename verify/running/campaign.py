"""A campaign: a Hypothesis settings profile run over backends x TP degrees within a time budget.

Each backend x TP slice is a search over the properties (TP > 1 through one shared worker pool);
every example is tallied for the report; a failure is shrunk by Hypothesis, then saved as an
artifact, and the slice searches again with the next seed while its share of the budget lasts.
A rank that dies or hangs ends its slice with an infrastructure error (its spec saved) and
the pool is rebuilt for the next slice. The report (JSON, Markdown, PNG) goes to ``out_dir``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hypothesis import Phase

from verify.cases.spec import BACKENDS, DTYPE_PAIRS, CaseSpec
from verify.cases.strategies import campaign_specs, invalid_specs
from verify.distributed import WorkerDied, WorkerError, WorkerHung, WorkerPool, needs_pool
from verify.distributed.errors import PoolError
from verify.execution.runner import Runner, case_of
from verify.properties.catalog import PROPERTIES
from verify.properties.verdict import HARNESS, harness_error
from verify.results import artifacts, report
from verify.running import compile_warmup, concurrent_searches, stage_timing
from verify.running.engine import run_property, search_rounds, seeds
from verify.running.mutants import MUTANTS
from verify.running.profiles import profile_settings
from verify.running.progress import Progress

# tolerances.yaml dtype key -> (hidden, weight) dtype pair of the spec
PAIR_OF = {h if h == w else f"{h}_{w}": (h, w) for h, w in DTYPE_PAIRS}


@dataclass(frozen=True)
class CampaignConfig:
    """What to run. ``max_examples`` overrides the profile's per-slice example count."""

    profile: str = "ci"
    backends: tuple[str, ...] = ("torch", "triton")
    tp_sizes: tuple[int, ...] = (1, 2, 4)
    budget_s: float = 300.0
    out_dir: Path = Path("results/campaign")
    failures_dir: Path | None = None  # default: out_dir / "failures"
    properties: tuple[str, ...] = ()  # empty: every property
    device: str = "cpu"
    seed: int | None = None
    mutant: str | None = None
    max_examples: int | None = None
    dtypes: tuple[str, ...] = ()  # tolerances.yaml dtype keys (fp32, bf16, fp32_bf16, ...); all
    # Concurrent searches per TP=1 slice (`verify.running.concurrent_searches`); None: its default
    # (several on CUDA, 1 on the CPU). TP > 1 slices run one search.
    searches: int | None = None

    def searches_at(self, tp: int) -> int:
        """How many searches a slice at TP degree ``tp`` runs at once."""
        if tp != 1:
            return 1
        return self.searches or concurrent_searches.default_count(self.device, tp)

    @property
    def dtype_pairs(self) -> tuple[tuple[str, str], ...]:
        """The (hidden, weight) dtype pairs of `dtypes` (all pairs when empty)."""
        return tuple(PAIR_OF[d] for d in self.dtypes) if self.dtypes else DTYPE_PAIRS

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def failures_path(self) -> Path:
        return self.failures_dir or self.out_dir / "failures"

    def validate(self) -> None:
        """Raise ValueError naming the bad option and the fix."""
        profile_settings(self.profile)  # unknown profile: the profiles module names the choices
        for backend in self.backends:
            if backend not in BACKENDS:
                raise ValueError(f"--backends: unknown backend {backend!r}; choose from {BACKENDS}")
        for tp in self.tp_sizes:
            if tp not in (1, 2, 4, 8):
                raise ValueError(f"--tp: TP degree must be one of 1, 2, 4, 8, got {tp}")
        if not self.backends or not self.tp_sizes:
            raise ValueError("--backends and --tp need at least one value each")
        if self.on_gpu:
            import torch

            gpus = torch.cuda.device_count()
            if gpus == 0:
                raise ValueError("--device cuda but no GPU is visible; use --device cpu (gloo)")
            if max(self.tp_sizes) > gpus:
                raise ValueError(
                    f"--tp {max(self.tp_sizes)} needs one GPU per rank; {gpus} visible "
                    f"(use --tp {','.join(str(t) for t in (1, 2, 4, 8) if t <= gpus)})"
                )
        if self.searches is not None and self.searches < 1:
            raise ValueError(f"--searches must be >= 1, got {self.searches}")
        if not self.budget_s > 0:
            raise ValueError(f"--budget-s must be > 0 seconds, got {self.budget_s}")
        for dtype in self.dtypes:
            if dtype not in PAIR_OF:
                raise ValueError(f"--dtypes: unknown {dtype!r}; choose from {', '.join(PAIR_OF)}")
        for name in self.properties:
            if name not in PROPERTIES:
                raise ValueError(f"--properties: unknown {name!r}; known: {', '.join(PROPERTIES)}")
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise ValueError(f"--mutant: unknown {self.mutant!r}; known: {', '.join(MUTANTS)}")


# After a failure a slice searches again (next seed) while its share of the budget lasts, so one
# early bug does not end the exploration; at most this many restarts per search, and none after
# a restart finds a failure of a class (properties, dtype, outputs) the slice already saved.
RESTARTS = 2


@dataclass
class CampaignResult:
    passed: bool
    report: dict[str, Any]
    paths: dict[str, Path | None]
    artifacts: list[Path] = field(default_factory=list)
    interrupted: str | None = None  # the signal that stopped it (SIGINT, SIGTERM)


class InfraFault(BaseException):
    """A rank died or hung twice on one case: stop the slice without shrinking (a BaseException,
    so Hypothesis does not treat it as the case's failure)."""

    def __init__(self, error: PoolError, spec: CaseSpec) -> None:
        super().__init__(str(error))
        self.error, self.spec = error, spec


def is_infrastructure(error: PoolError) -> bool:
    """A rank died or hung, or one left the others stuck: the workers, not the case, failed."""
    if isinstance(error, WorkerError):
        return not error.pool_intact
    return isinstance(error, WorkerDied | WorkerHung)


class _GuardedRunner(Runner):
    """A dead or hung rank is an infrastructure error, never a verdict: ``on_fault`` reports it
    (rank and job in the message) and the case runs once more on the rebuilt pool. A second
    fault raises `InfraFault`, and so does every later run (Hypothesis re-running the case then
    sees the same outcome, never a flaky one). A job that raised stays the case's outcome."""

    def __init__(self, *args: Any, on_fault: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_fault = on_fault
        self.fault: PoolError | None = None

    def run(self, spec: CaseSpec, *, fresh: bool = False):
        if self.fault is not None:
            raise InfraFault(self.fault, spec)
        for attempt in (1, 2):
            try:
                result = super().run(spec, fresh=fresh)
            except PoolError as error:
                if not is_infrastructure(error):
                    raise
                retry = "case rerun on the rebuilt pool" if attempt == 1 else "again: slice ended"
                self.on_fault(f"{error.args[0].splitlines()[0]}; {retry}; spec {spec.to_json()}")
                if attempt == 2:
                    self.fault = error
                    raise InfraFault(error, spec) from error
            else:
                return result
        raise AssertionError("unreachable")


def run_campaign(
    config: CampaignConfig, progress: Progress | None = None, pool: WorkerPool | None = None
) -> CampaignResult:
    """Run each backend x TP slice of ``config`` and write the report; a failure does not raise.

    TP > 1 slices (every slice on CUDA: a rank owns a GPU) use ``pool`` when given (left open),
    else a pool made and closed here.
    """
    config.validate()
    if config.seed is None and not profile_settings(config.profile).derandomize:
        # A random profile still draws from a recorded seed: the report's seed repeats the
        # search (`--seed`), and Hypothesis prints no seed of its own when the budget stops it.
        config = replace(config, seed=secrets.randbits(64))
    own_pool = pool is None
    progress = progress or Progress(config.profile, config.budget_s, stream=sys.stderr)
    tally, saved = report.Tally(), []
    began = time.monotonic()
    deadline = began + config.budget_s
    slices = [(b, tp) for b in config.backends for tp in config.tp_sizes]
    exhausted, interrupted, search = False, None, None
    warmup = None
    if config.on_gpu and "triton" in config.backends:
        warmup = compile_warmup.start(config.dtype_pairs)
    with stop_signals() as received:
        try:
            for index, (backend, tp) in enumerate(slices):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    exhausted = True
                    tally.slices.append(_slice_row(backend, tp, "skipped (budget)", 0, [], 0.0))
                    continue
                search = None
                count = config.searches_at(tp)
                if count == 1 and needs_pool(tp, config.device) and pool is None:
                    pool = WorkerPool(world_size=max(config.tp_sizes), device=config.device)
                share = remaining / (len(slices) - index)  # time left over flows to later slices
                progress.start_slice(backend, tp)
                if count == 1:
                    search = _Slice(config, backend, tp, tally, progress)
                else:  # each search opens its own worker
                    search = concurrent_searches.ConcurrentSlice(
                        config, backend, tp, tally, progress, count=count, seed_stride=1 + RESTARTS
                    )
                search.deadlines = (time.monotonic() + share, deadline)
                try:
                    search.run(pool, with_status=backend == config.backends[0])
                    if stop_requested():  # the interrupt was swallowed on its way up
                        raise KeyboardInterrupt(received.name)
                except KeyboardInterrupt:
                    if not overrun_stopped():
                        raise
                    search.status = "overrun"  # the search's own watchdog stopped it
                    search.save_unsaved()
                    tally.add_error(f"{backend} TP={tp}", overrun_error())
                exhausted |= search.status in ("budget", "overrun")
                saved.extend(search.artifacts)
                tally.slices.append(search.row())
                search = None
        except KeyboardInterrupt:  # SIGINT, or SIGTERM through `stop_signals`
            interrupted = received.name
            if search is not None:  # the slice it stopped: its examples and any unsaved failure
                search.status = "interrupted"
                search.save_unsaved()
                saved.extend(search.artifacts)
                tally.slices.append(search.row())
            for backend, tp in slices[len(tally.slices) :]:  # not begun (or stopped between two)
                tally.slices.append(_slice_row(backend, tp, "not run (interrupted)", 0, [], 0.0))
        finally:
            if warmup is not None:
                compile_warmup.stop(warmup)
            if own_pool and pool is not None:
                pool.close()
            progress.finish(interrupted)
        meta = _meta(config, time.monotonic() - began, exhausted, interrupted)
        document, paths = report.write(tally, meta, config.out_dir)
    return CampaignResult(document["passed"], document, paths, saved, interrupted)


# How long past the campaign's deadline a search may still run (an example or a shrink step in
# flight; on CUDA one example is under a second) before its watchdog stops it like SIGTERM would:
# its unsaved failure saved unshrunk, the slice's status "overrun", an infrastructure error.
OVERRUN_GRACE_S = 30.0


class _Received:
    """Which stop signal arrived (``SIGINT`` unless `stop_signals` saw another)."""

    name = "SIGINT"


# Set by a stop signal inside `stop_signals`: the KeyboardInterrupt it raises may be caught on its
# way up and surface as another exception (a bare AssertionError: exit 3, "infrastructure error",
# seen in a fresh-clone test run), or vanish where Python ignores exceptions (a garbage-collector
# callback of Hypothesis: "Exception ignored in ... gc_callback" and the campaign ran on, seen in
# the next). Searches check it between examples and after they end.
_stop_arrived = threading.Event()
# Set by `overrun_watch` when it stops the search: that stop is the budget's, not an operator's.
_overran = threading.Event()
# Whether `stop_signals` handlers are installed now (a watchdog only signals through them).
_handlers_installed = threading.Event()


def stop_requested() -> bool:
    """A stop signal arrived in the `stop_signals` block now running."""
    return _stop_arrived.is_set()


def overrun_error() -> str:
    """The infrastructure error of a slice whose search overran the budget."""
    return (
        f"a search still ran {OVERRUN_GRACE_S:g} s past the budget and was stopped (a failure "
        "it had found is saved, unshrunk)"
    )


def overrun_stopped() -> bool:
    """The stop now in progress is `overrun_watch`'s (the search overran the budget), and it is
    taken: stop signals work again, for the next one."""
    if not _overran.is_set():
        return False
    _overran.clear()
    _stop_arrived.clear()
    return True


@contextlib.contextmanager
def overrun_watch(deadline: float) -> Iterator[None]:
    """Stop the block (KeyboardInterrupt, through `stop_signals`' handler) if it still runs
    `OVERRUN_GRACE_S` past ``deadline`` (``time.monotonic()``): wherever it is, inside an example
    that does not end or anywhere else `run_property`'s checks (at each example's end and each
    candidate of Hypothesis's engine) do not reach. A real signal, so a blocking call is woken
    too; the process's stacks go to stderr first. Nothing happens outside a `stop_signals` block
    of the main thread."""
    if not math.isfinite(deadline) or threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident

    def stop() -> None:
        if _handlers_installed.is_set() and not _stop_arrived.is_set():
            print(f"search process {os.getpid()} overran the budget; its stacks:", file=sys.stderr)
            faulthandler.dump_traceback(sys.stderr)  # where it was: the next fix's evidence
            _overran.set()
            signal.pthread_kill(main, signal.SIGTERM)

    timer = threading.Timer(max(0.0, deadline + OVERRUN_GRACE_S - time.monotonic()), stop)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@contextlib.contextmanager
def stop_signals() -> Iterator[_Received]:
    """SIGINT and SIGTERM stop the block with ``KeyboardInterrupt`` (the yielded object names
    the signal); after the first, both are ignored until the block ends, so stopping the pool
    and writing the report finish. Previous handlers come back afterwards. Outside the main
    thread (no signal handlers there) nothing changes."""
    received = _Received()
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def stop(signum: int, frame: Any) -> None:
        _stop_arrived.set()
        if _overran.is_set():  # the budget's watchdog: operators' signals still stop the run
            raise KeyboardInterrupt("overrun")
        received.name = signal.Signals(signum).name
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(received.name)

    unraisable_hook = sys.unraisablehook

    def quiet_stop(unraisable: Any) -> None:
        """Our stop, raised where it cannot propagate: `stop_requested` carries it on."""
        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and stop_requested()):
            unraisable_hook(unraisable)

    _stop_arrived.clear()
    _overran.clear()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    sys.unraisablehook = quiet_stop
    _handlers_installed.set()
    try:
        yield received
    finally:
        _handlers_installed.clear()
        sys.unraisablehook = unraisable_hook
        _stop_arrived.clear()
        _overran.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Slice:
    """One Hypothesis search at one backend x TP degree."""

    def __init__(
        self, config: CampaignConfig, backend: str, tp: int, tally: report.Tally, progress: Progress
    ) -> None:
        self.config, self.backend, self.tp = config, backend, tp
        self.tally, self.progress = tally, progress
        self.names = list(config.properties or PROPERTIES)
        self.status, self.examples, self.seconds = "done", 0, 0.0
        self.artifacts: list[Path] = []
        self.current: CaseSpec | None = None  # the last drawn spec: after shrinking, the minimal
        self.names_now: list[str] = []  # the properties the running search checks
        self.failed = False  # the search found a failure: later examples are shrinking re-runs
        # Searching stops at the slice's share of the budget; shrinking may go on to the end of
        # the campaign's budget (a found failure is worth more than later slices' examples).
        self.deadlines = (math.inf, math.inf)
        self.signatures: set[tuple] = set()  # (properties, dtype, error, outputs) of saved failures
        # time.monotonic() at the end of the last example (its wall time); one clock for every
        # process on the host, so concurrent searches' examples fall on one time line
        self.example_began = 0.0
        # The search's first failing example and its failing verdicts until they are saved
        # (shrunk): what an interrupted search still reports.
        self.unsaved: tuple[CaseSpec, list[Any], list[str]] | None = None

    def row(self) -> dict[str, Any]:
        """This slice's line of the report's slice table."""
        return _slice_row(
            self.backend, self.tp, self.status, self.examples, self.artifacts, self.seconds
        )

    def save_unsaved(self) -> None:
        """Save the failure the search found but had not finished shrinking (unshrunk)."""
        if self.unsaved is not None:
            spec, failing, names = self.unsaved
            self._save(spec, names, failing, None, self.examples, shrunk=False)

    def run(self, pool: WorkerPool | None, with_status: bool) -> None:
        """The status search (invalid inputs, cheap) first when asked, then the valid cases."""
        # A slice that runs in this process sees no pool (no megatron peer at CPU TP=1).
        on_pool = needs_pool(self.tp, self.config.device)
        runner = _GuardedRunner(
            pool if on_pool else None,
            self.config.mutant,
            on_fault=lambda message: self.tally.add_error(f"{self.backend} TP={self.tp}", message),
        )
        valid = [n for n in self.names if n != "status"]
        searches = []
        if with_status and "status" in self.names:
            searches.append((["status"], invalid_specs(tp_sizes=(self.tp,))))
        if valid:
            specs = campaign_specs(
                backends=(self.backend,), tp_sizes=(self.tp,), pairs=self.config.dtype_pairs
            )
            searches.append((valid, specs))
        began = time.monotonic()
        try:
            with overrun_watch(self.deadlines[1]):
                for names, strategy in searches:
                    self.names_now = names

                    def again(seed: int | None, names=names, strategy=strategy) -> bool:
                        found = self._search(names, strategy.map(self._draw), runner, seed)
                        in_time = time.monotonic() <= self.deadlines[0]
                        return found and self.status == "done" and in_time

                    search_rounds(itertools.islice(seeds(self.config.seed), 1 + RESTARTS), again)
                    if self.status != "done":
                        break
        finally:
            self.seconds = time.monotonic() - began

    def _search(self, names: list[str], strategy: Any, runner: Runner, seed: int | None) -> bool:
        """One Hypothesis search; its shrunk failure (or minimal raising case) is saved.
        Returns whether it found a failure."""
        self.failed, self.current, self.unsaved = False, None, None
        stage_timing.current().take()  # what ran before this search is no example's
        self.example_began = time.monotonic()
        saved = len(self.artifacts)
        try:
            result = run_property(
                names,
                strategy=strategy,
                profile=self.config.profile,
                runner=runner,
                max_examples=self.config.max_examples,
                seed=seed,
                on_example=self._on_example,
                deadlines=self.deadlines,
            )
            if stop_requested():  # Hypothesis caught the interrupt: its result is not a finding
                raise KeyboardInterrupt
            if result.stopped:
                self.status = "budget"
            shrunk = False if result.stopped else None  # when stopped, shrinking's best so far
            for index, failing in enumerate(result.failures):
                at = result.first_failure_at if index == 0 else None
                self._save(CaseSpec.from_json(failing[0].spec), names, failing, None, at, shrunk)
            for spec, exc in result.errors:
                self._save_error(spec, names, exc)
        except InfraFault:  # reported by the runner; no failure artifact: lce did not fail
            self.status = "infrastructure error"
        except Exception as exc:  # the case raised; Hypothesis shrank it
            if stop_requested():  # what the interrupt left behind, not the case's outcome
                raise KeyboardInterrupt from exc
            self._save_error(case_of(exc), names, exc)
        return len(self.artifacts) > saved

    def _save_error(self, spec: CaseSpec | None, names: list[str], exc: Exception) -> None:
        """Save an exception the search raised as an error artifact on ``spec``, the spec it was
        raised on. One raised on no spec did not come out of running a case (`case_of`): the
        search's own (Hypothesis, the strategies), a `harness_error` verdict on the last drawn
        spec (exit 4: no verdict on the implementation)."""
        if spec is None and self.current is not None:
            verdict = harness_error(",".join(names), self.current, exc)
            self._save(self.current, names, [verdict], None, None)
            return
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        self._save(spec, names, [], f"{type(exc).__name__}: {first_line}", None)

    def _draw(self, spec: CaseSpec) -> CaseSpec:
        self.current = spec
        return spec

    def _on_example(self, spec: CaseSpec, verdicts: list[Any]) -> None:
        if stop_requested():  # an interrupt that vanished on its way up: stop here
            raise KeyboardInterrupt
        if self.failed:  # shrinking re-runs are not new examples
            return
        self.examples += 1
        now, taken = time.monotonic(), stage_timing.current().take()
        kind = "status" if self.names_now == ["status"] else "numerical"
        self.tally.add_timing(self.backend, kind, taken, now - self.example_began, ended=now)
        self.example_began = now
        self.tally.add_example(spec.dtype_key, spec.backend, spec.tp, verdicts)
        self.progress.example()
        failing = [v for v in verdicts if v.failed]
        self.failed = bool(failing)
        if failing:
            self.unsaved = (spec, failing, self.names_now)

    def _save(
        self,
        spec: CaseSpec | None,
        names: list[str],
        verdicts: list[Any],
        error: str | None,
        at: int | None,
        shrunk: bool | None = None,
    ) -> None:
        """Save an artifact and tally the failure. ``shrunk`` defaults to the profile's phases."""
        if spec is None:  # nothing was drawn: the search failed before its first example
            self.tally.add_error(f"{self.backend} TP={self.tp}", error or "search failed")
            return
        if shrunk is None:
            shrunk = Phase.shrink in profile_settings(self.config.profile).phases
        failing = [v for v in verdicts if v.failed]
        props = sorted({v.property for v in failing}) or names
        record = artifacts.make_record(
            spec,
            ",".join(props),
            failing,
            shrunk=shrunk,
            device=self.config.device,
            error=error,
            mutant=self.config.mutant,
            examples=at,
        )
        self.unsaved = None
        signature = (record["property"], spec.dtype_key, error, *sorted(v.output for v in failing))
        if signature in self.signatures:  # a restarted search found the same failure class
            return
        self.signatures.add(signature)
        path = artifacts.write(record, self.config.failures_path)
        self.artifacts.append(path)
        worst = max(failing, key=lambda v: report.order(v.ratio), default=None)
        self.tally.add_failure(
            {
                "property": record["property"],
                "output": worst.output if worst else "error",
                "backend": spec.backend,
                "tp": spec.tp,
                "dtype": spec.dtype_key,
                "ratio": artifacts.json_number(worst.ratio if worst else float("inf")),
                "artifact": str(path),
                "shrunk": record["shrunk"],
                "line": worst.line() if worst else error,
                "harness": any(v.tier == HARNESS for v in failing),
            }
        )
        self.progress.failure()


def _slice_row(
    backend: str, tp: int, status: str, examples: int, saved: list[Path], seconds: float
) -> dict[str, Any]:
    return {
        "backend": backend,
        "tp": tp,
        "status": status,
        "examples": examples,
        "failures": len(saved),
        "wall_s": round(seconds, 2),
        "examples_per_s": round(examples / seconds, 3) if seconds > 0 else None,
    }


def _meta(
    config: CampaignConfig, wall_s: float, exhausted: bool, interrupted: str | None
) -> dict[str, Any]:
    return {
        "title": f"{config.profile} campaign",
        "interrupted": interrupted,
        "profile": config.profile,
        "backends": list(config.backends),
        "tp_sizes": list(config.tp_sizes),
        "properties": list(config.properties or PROPERTIES),
        "budget_s": config.budget_s,
        "budget_exhausted": exhausted,
        "wall_s": round(wall_s, 2),
        "seed": config.seed,
        "mutant": config.mutant,
        "dtypes": list(config.dtypes) or None,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - wall_s)),
        "environment": {
            "versions": artifacts.versions(),
            "device": artifacts.device_description(config.device),
        },
    }
