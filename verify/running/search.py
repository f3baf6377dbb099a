"""One slice of a campaign: the searches of one implementation at one backend x TP degree.

A slice searches its properties with Hypothesis (`verify.running.engine.run_property`): the status
examples (invalid inputs) first when asked, then valid cases, each search starting from the
landmark specs (one per input class) and the slice's pairwise covering rows
(`verify.running.pairwise`). Every example is tallied for the report; a failure is shrunk,
saved as an artifact, and the slice searches again with the next seed while its share of the
budget lasts, leaving out what it has found (`Exclusions`), so one early bug does not hide the
others. The cases run on the slice's worker pool through a `Runner`, which turns a crash or a hang
into a finding and a machine's fault into an infrastructure error.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from hypothesis import Phase
from hypothesis import strategies as st

from verify.adapters.features import coerce
from verify.adapters.interface import Adapter
from verify.cases.spec import CaseSpec
from verify.cases.strategies import campaign_specs, invalid_specs, landmarks_at
from verify.distributed.seam import Pool
from verify.execution import stage_timing
from verify.execution.deadline import BudgetExhausted
from verify.execution.runner import InfraFault, Runner, case_of, error_line
from verify.properties.verdict import HARNESS, PropertyVerdict, harness_error, is_fault, is_refusal
from verify.results import artifacts, report
from verify.running import stopping
from verify.running.config import CampaignConfig
from verify.running.engine import check_case, run_property, seeds
from verify.running.pairwise import plan_slice
from verify.running.profiles import profile_settings
from verify.running.reduce import reduce_failure

# After a failure a slice searches again (next seed) while its share of the budget lasts; at most
# this many restarts per search, and none when what it found cannot be left out.
RESTARTS = 2
# Spec fields whose non-default value in a shrunk failure marks what triggered it (sizes and
# numbers are left out: they shrink on their own; transform/fault/backend are set by properties).
SIZES = ("tokens", "hidden_size", "vocab")
_NOT_TRIGGERS = (
    *SIZES,
    "seed",
    "scale",
    "offset",
    "chunk_size",
    "transform",
    "fault",
    "backend",
    "tp",
)
TRIGGER_FIELDS = tuple(f for f in CaseSpec.__dataclass_fields__ if f not in _NOT_TRIGGERS)


@dataclass
class Exclusions:
    """What later searches of a slice leave out: the triggers of its findings. A numerical failure
    is left out by the fields its shrunk spec needs (`trigger`); a refusal of a valid case, a
    crash or a hang by the fields, sizes included, whose simplest value makes the implementation
    run the case (`probe`: it cannot run that region at all). ``everything``: the simplest case
    itself was refused (nothing left to search)."""

    adapter: Adapter
    runner: Runner
    triggers: list[dict[str, Any]] = field(default_factory=list)
    everything: bool = False

    def allows(self, spec: CaseSpec) -> bool:
        return not any(_has(spec, found) for found in self.triggers)

    def absorb(self, failing: list[PropertyVerdict], probe_until: float) -> bool:
        """Leave out what a saved failure needs; returns whether there was something to leave
        out (a further search can then find something else). Probing (a refusal, a crash, a
        hang: each probe that fails so costs a worker or a deadline) stops at ``probe_until``
        (``time.monotonic()``)."""
        spec = CaseSpec.from_json(failing[0].spec)
        if all(is_refusal(v) or is_fault(v) for v in failing):
            found = self.probe(spec, probe_until)
            self.everything |= not found and all(is_refusal(v) for v in failing)
        else:
            found = trigger(self.adapter, spec)
        if not found or found in self.triggers:
            return False
        self.triggers.append(found)
        return True

    def probe(self, spec: CaseSpec, until: float = math.inf) -> dict[str, Any]:
        """The fields of a refused (crashed, hung) ``spec`` the failure needs: each field away
        from the simplest spec's value whose simplest value makes the implementation run the
        case. A landmark spec is not shrunk, so each field is tried, not assumed; past ``until``
        the fields left are kept untried (the trigger stays narrow)."""
        simplest = coerce(self.adapter, CaseSpec())
        found = {}
        for name in (*SIZES, *TRIGGER_FIELDS):
            value = getattr(spec, name)
            if value == getattr(simplest, name):
                continue
            try:
                probe = spec.with_(**{name: getattr(simplest, name)})
            except ValueError:
                found[name] = value  # e.g. vocab < tp: cannot tell, keep it
                continue
            late = time.monotonic() > until
            if late or self.adapter.capabilities.limits.violations(probe) or self._runs(probe):
                found[name] = value
        return found

    def _runs(self, spec: CaseSpec) -> bool:
        """Whether the implementation runs ``spec``; True too when the budget or the workers
        cannot tell (the field is then kept: the trigger stays narrow)."""
        try:
            return self.runner.run(spec).status == "ok"
        except (BudgetExhausted, InfraFault):
            return True
        except Exception:  # a crash or a hang again: the field is not what it needs
            return False


def trigger(adapter: Adapter, spec: CaseSpec, sizes: bool = False) -> dict[str, Any]:
    """The fields of a shrunk ``spec`` that differ from the simplest spec the adapter gets:
    shrinking moves every field it can back to its default, so these are what the failure needs
    (``sizes``: the sizes too, which otherwise shrink on their own)."""
    simplest = coerce(adapter, CaseSpec())
    found = {
        name: getattr(spec, name)
        for name in (*SIZES, *TRIGGER_FIELDS)
        if sizes or name in TRIGGER_FIELDS
        if getattr(spec, name) != getattr(simplest, name)
    }
    if spec.tokens == 0:
        found["tokens"] = 0  # empty input: a class of its own
    return found


def _has(spec: CaseSpec, found: dict[str, Any]) -> bool:
    return all(getattr(spec, name) == value for name, value in found.items())


class SliceSearch:
    """The searches of ``adapter`` at ``backend`` x TP ``tp`` over the property ``names``."""

    def __init__(
        self,
        config: CampaignConfig,
        adapter: Adapter,
        backend: str,
        tp: int,
        names: tuple[str, ...],
        tally: Any,
        progress: Any,
        part: tuple[int, int] = (0, 1),
    ) -> None:
        self.config, self.adapter, self.backend, self.tp = config, adapter, backend, tp
        self.names, self.tally, self.progress = names, tally, progress
        # (k, n): this search runs every n-th planned example from the k-th, one of n
        # concurrent searches of the slice (`verify.running.concurrent_searches`)
        self.part = part
        self.where = f"{adapter.label(backend)} TP={tp}"
        self.status, self.examples, self.seconds = "done", 0, 0.0
        self.artifacts: list[Path] = []
        self.current: CaseSpec | None = None  # the last drawn spec: after shrinking, the minimal
        self.names_now: tuple[str, ...] = ()  # the properties the running search checks
        self.failed = False  # the search found a failure: later examples are shrinking re-runs
        # Searching stops at the slice's share of the budget; shrinking may go on to the end of
        # the campaign's budget (a found failure is worth more than later slices' examples).
        self.deadlines = (math.inf, math.inf)
        # The planned examples (landmarks, covering rows) may run past the share, to here (None:
        # the campaign's end): coverage first, but later slices keep a little (`campaign`).
        self.explicit_until: float | None = None
        self.explicit_run = 0  # planned examples the last search ran
        self.signatures: set[tuple] = set()  # (properties, dtype, error, outputs) of saved failures
        # time.monotonic() at the end of the last example (its wall time); one clock for every
        # process on the host, so concurrent searches' examples fall on one time line
        self.example_began = 0.0
        # The search's first failing example and its failing verdicts until they are saved
        # (shrunk): what an interrupted search still reports.
        self.unsaved: tuple[CaseSpec, list[PropertyVerdict], tuple[str, ...]] | None = None
        self.runner: Runner | None = None

    def row(self) -> dict[str, Any]:
        """This slice's line of the report's slice table."""
        return slice_row(self.where, self.status, self.examples, self.artifacts, self.seconds)

    def save_unsaved(self) -> None:
        """Save the failure the search found but had not finished shrinking (unshrunk)."""
        if self.unsaved is not None:
            spec, failing, names = self.unsaved
            self._save(spec, names, failing, None, self.examples, shrunk=False)

    def run(self, pool: Pool, with_status: bool) -> None:
        """The status search (invalid inputs, cheap) first when asked, then the valid cases."""
        deadline = self.config.example_deadline()
        runner = Runner(
            pool, self.config.mutant, adapter=self.adapter, deadline=deadline,
            on_fault=lambda message: self.tally.add_error(self.where, message),
        )  # fmt: skip
        self.runner = runner
        exclusions = Exclusions(self.adapter, runner)
        began = time.monotonic()
        stacks = stopping.stacks_file(self.config.out_dir)
        try:
            with stopping.overrun_watch(lambda: self.deadlines[1] + deadline.seconds(), stacks):
                for names, strategy, landmarks in self._searches(with_status):
                    self.names_now = names
                    self._rounds(names, strategy, landmarks, runner, exclusions)
                    if self.status != "done":
                        break
        finally:
            self.seconds = time.monotonic() - began

    def _searches(self, with_status: bool) -> list[tuple[tuple[str, ...], Any, list[CaseSpec]]]:
        """(properties, strategy, landmark specs) of each search, the status one first."""
        fit = partial(coerce, self.adapter)
        searches = []
        if with_status and "status" in self.names:
            faulty = invalid_specs(tp_sizes=(self.tp,)).map(fit).map(_at_least_one_token)
            searches.append((("status",), faulty, []))
        valid = tuple(n for n in self.names if n != "status")
        if valid:
            caps = self.adapter.capabilities
            pairs = tuple(p for p in self.config.dtype_pairs if p in caps.dtype_pairs)
            pairs = pairs or caps.dtype_pairs
            specs = campaign_specs(
                backends=(self.backend,), tp_sizes=(self.tp,), pairs=pairs,
                loss_paths=caps.loss_paths, dtensors=("none", *caps.dtensor_weights),
            )  # fmt: skip
            extents = self.config.extents_at(self.backend)
            marks = [fit(s) for s in landmarks_at(self.tp, self.backend)]
            marks = [
                s for i, s in enumerate(marks)
                if s not in marks[:i] and _pair(s) in pairs and s.extent in extents
            ]  # fmt: skip
            planned = marks + self._covering_rows(valid, marks)
            searches.append((valid, specs.map(fit), planned[self.part[0] :: self.part[1]]))
        return searches

    def _covering_rows(self, names: tuple[str, ...], marks: list[CaseSpec]) -> list[CaseSpec]:
        """The slice's pairwise covering rows (`verify.running.pairwise`), their data drawn
        from the campaign's seed; the plan goes to the report, which counts against it."""
        config = self.config
        plan = plan_slice(
            self.adapter, self.backend, self.tp, names, tuple(marks), config.dtype_pairs,
            config.exclude,
        )  # fmt: skip
        self.tally.add_coverage(self.adapter.label(self.backend), self.tp, plan.record())
        offset = config.seed or 0
        return [spec.with_(seed=(spec.seed + offset) % 2**16) for spec in plan.rows]

    def _rounds(self, names, strategy, landmarks, runner: Runner, exclusions: Exclusions) -> None:
        """Searches at the config's seeds until one finds nothing new, the share of the budget
        is spent, or `RESTARTS` restarts; each leaves out what the earlier ones found. A failure
        on a planned example ends its search (it is reduced while there is time); the next
        search goes on with the planned examples after it."""

        def allowed(spec: CaseSpec) -> bool:
            return exclusions.allows(spec) and not self.config.excluded(spec)

        pending = list(landmarks)  # the planned examples not yet run
        for seed in itertools.islice(seeds(self.config.seed), 1 + RESTARTS):
            narrowed = strategy.filter(allowed)
            examples = [s for s in pending if allowed(s)]
            runner.new_search(self.deadlines[1])
            found = self._search(names, narrowed, runner, seed, examples)
            pending = examples[self.explicit_run :]
            new = [exclusions.absorb(failing, self.deadlines[0]) for failing in found]
            due = self.deadlines[0] if not pending else self._explicit_until()
            in_time = time.monotonic() <= due
            if not (any(new) and not exclusions.everything and self.status == "done" and in_time):
                return

    def _explicit_until(self) -> float:
        return self.deadlines[1] if self.explicit_until is None else self.explicit_until

    def _search(
        self,
        names: tuple[str, ...],
        strategy: st.SearchStrategy[CaseSpec],
        runner: Runner,
        seed: int | None,
        examples: list[CaseSpec],
    ) -> list[list[PropertyVerdict]]:
        """One Hypothesis search; its shrunk failures (or minimal raising cases) are saved.
        Returns the failing verdicts it found, a class saved before included: met again in
        another region (an fp32 precision class on an offset row after a peaked one), its region
        is left out all the same, or it would end the slice with the rest of its plan unrun."""
        self.failed, self.current, self.unsaved = False, None, None
        stage_timing.current().take()  # what ran before this search is no example's
        self.example_began = time.monotonic()
        found: list[list[PropertyVerdict]] = []
        try:
            result = run_property(
                names, strategy=strategy.map(self._draw), profile=self.config.profile,
                runner=runner, max_examples=self.config.max_examples, seed=seed,
                on_example=self._on_example, deadlines=self.deadlines, examples=examples,
                explicit_until=self._explicit_until(), explicit_failure_ends=True,
            )  # fmt: skip
            self.explicit_run = result.explicit_run
            if stopping.stop_requested():  # Hypothesis caught the interrupt: not a finding
                raise KeyboardInterrupt
            if result.stopped:
                self.status = "budget"
            shrunk = False if result.stopped else None  # when stopped, shrinking's best so far
            for index, failing in enumerate(result.failures):
                at = result.first_failure_at if index == 0 else None
                spec = CaseSpec.from_json(failing[0].spec)
                reduced = shrunk
                if spec in examples:  # Hypothesis does not shrink an explicit example: we do
                    spec, failing = self._reduce(spec, failing, names, runner)
                    reduced = not result.stopped and time.monotonic() < self.deadlines[1]
                self._save(spec, names, failing, None, at, reduced)
                found.append(failing)
            for spec, exc in result.errors:
                self._save_error(spec, names, exc)
        except InfraFault:  # reported by the runner; no failure artifact: nothing failed
            self.status = "infrastructure error"
        except Exception as exc:  # the case raised; Hypothesis shrank it
            if stopping.stop_requested():  # what the interrupt left behind, not the outcome
                raise KeyboardInterrupt from exc
            self._save_error(case_of(exc), names, exc)
        return found

    def _reduce(
        self, spec: CaseSpec, failing: list[PropertyVerdict], names: tuple[str, ...], runner: Runner
    ) -> tuple[CaseSpec, list[PropertyVerdict]]:
        """A landmark's failure, reduced (`reduce_failure`) within the campaign's budget."""

        def check(candidate: CaseSpec) -> list[PropertyVerdict]:
            return check_case(candidate, properties=names, runner=runner)

        simplest = coerce(self.adapter, CaseSpec(backend=self.backend, tp=self.tp))
        return reduce_failure(spec, failing, check, simplest, self.deadlines[1])

    def _save_error(self, spec: CaseSpec | None, names: tuple[str, ...], exc: Exception) -> None:
        """Save an exception the search raised as an error artifact on ``spec``, the spec it was
        raised on. One raised on no spec did not come out of running a case (`case_of`): the
        search's own (Hypothesis, the strategies), a `harness_error` verdict on the last drawn
        spec (exit 4: no verdict on the implementation)."""
        if spec is None and self.current is not None:
            verdict = harness_error(",".join(names), self.current, exc)
            self._save(self.current, names, [verdict], None, None)
            return
        self._save(spec, names, [], error_line(exc), None)

    def _draw(self, spec: CaseSpec) -> CaseSpec:
        self.current = spec
        return spec

    def _on_example(self, spec: CaseSpec, verdicts: list[PropertyVerdict]) -> None:
        if stopping.stop_requested():  # an interrupt that vanished on its way up: stop here
            raise KeyboardInterrupt
        if self.failed:  # shrinking re-runs are not new examples
            return
        self.examples += 1
        now, taken = time.monotonic(), stage_timing.current().take()
        kind = "status" if self.names_now == ("status",) else "numerical"
        label = self.adapter.label(self.backend)
        self.tally.add_timing(label, kind, taken, now - self.example_began, ended=now)
        self.example_began = now
        self.tally.add_example(spec.dtype_key, label, spec.tp, verdicts, spec=spec)
        self.progress.example()
        failing = [v for v in verdicts if v.failed]
        self.failed = bool(failing)
        if failing:
            self.unsaved = (spec, failing, self.names_now)

    def _deadline_of(self, failing: list[PropertyVerdict]) -> float | None:
        """The per-example deadline a failure was found under: where the implementation crashed
        or hung, the one its fault was confirmed under (the deadline grows with later examples)."""
        if self.runner is None:
            return None
        confirmed = self.runner.fault_deadline_s
        if confirmed is not None and any(is_fault(v) for v in failing):
            return confirmed
        return self.runner.deadline.seconds()

    def _save(
        self,
        spec: CaseSpec | None,
        names: tuple[str, ...],
        verdicts: list[PropertyVerdict],
        error: str | None,
        at: int | None,
        shrunk: bool | None = None,
    ) -> bool:
        """Save an artifact and tally the failure (``shrunk`` defaults to the profile's phases);
        returns whether it was new (not a class already saved)."""
        if spec is None:  # nothing was drawn: the search failed before its first example
            self.tally.add_error(self.where, error or "search failed")
            return False
        signature = _signature(spec, verdicts, error)
        if shrunk is None:
            shrunk = Phase.shrink in profile_settings(self.config.profile).phases
        failing = [v for v in verdicts if v.failed]
        props = sorted({v.property for v in failing}) or list(names)
        record = artifacts.make_record(
            spec, ",".join(props), failing, shrunk=shrunk, device=self.config.device, error=error,
            mutant=self.config.mutant, examples=at, impl=self.adapter,
            example_deadline_s=self._deadline_of(failing),
            example_deadline_fixed=self.runner is not None and self.runner.deadline.fixed,
        )  # fmt: skip
        self.unsaved = None
        if signature in self.signatures:  # a restarted search found the same failure class
            return False
        self.signatures.add(signature)
        path = artifacts.write(record, self.config.failures_path)
        self.artifacts.append(path)
        worst = max(failing, key=lambda v: report.order(v.ratio), default=None)
        self.tally.add_failure(
            {
                "property": record["property"],
                "output": worst.output if worst else "error",
                "tier": worst.tier if worst else "error",
                "impl": record["impl"],
                "backend": record["backend"],
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
        return True


def _signature(spec: CaseSpec, verdicts: list[PropertyVerdict], error: str | None) -> tuple:
    """The class of a failure, saved once per slice: its properties, dtype, error and outputs;
    a crash or a hang by its kind alone (every case that meets it fails so, whatever its dtype;
    what it needs is left out afterwards, `Exclusions`)."""
    failing = [v for v in verdicts if v.failed]
    kinds = sorted({v.tier for v in failing if is_fault(v)})
    if kinds:
        return ("fault", *kinds)
    props = ",".join(sorted({v.property for v in failing}))
    return (props, spec.dtype_key, error, *sorted(v.output for v in failing))


def _pair(spec: CaseSpec) -> tuple[str, str]:
    return spec.hidden_dtype, spec.weight_dtype


def _at_least_one_token(spec: CaseSpec) -> CaseSpec:
    return spec.with_(tokens=max(spec.tokens, 1))


def slice_row(
    where: str, status: str, examples: int, saved: list[Path], seconds: float
) -> dict[str, Any]:
    """One line of the report's slice table."""
    backend, _, tp = where.rpartition(" TP=")
    return {
        "backend": backend,
        "tp": int(tp),
        "status": status,
        "examples": examples,
        "failures": len(saved),
        "wall_s": round(seconds, 2),
        "examples_per_s": round(examples / seconds, 3) if seconds > 0 else None,
    }
