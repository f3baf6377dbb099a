"""What a campaign runs: `CampaignConfig`, validated with errors naming the option and the fix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from verify.cases.spec import BACKENDS, DTYPE_PAIRS, EXTENTS, CaseSpec
from verify.execution.deadline import ExampleDeadline
from verify.execution.mutants import MUTANTS
from verify.properties.catalog import PROPERTIES
from verify.running.profiles import example_deadline_floor, profile_settings

# tolerances.yaml dtype key -> (hidden, weight) dtype pair of the spec
PAIR_OF = {h if h == w else f"{h}_{w}": (h, w) for h, w in DTYPE_PAIRS}
TP_DEGREES = (1, 2, 4, 8)
# A campaign's default wall-clock budget. On 2 cores the ci profile's planned examples on the
# torch backend (landmarks and covering rows at TP 1, 2 and 4) take about 240 s, TP = 4's ~120 s
# of it (a new graph per row for the compiled property on 4 ranks); at 300 s, with the Triton
# interpreter's slices keeping their floor, TP = 4 reached 97% of its pairs. 420 s leaves ~75 s
# of slack for a slower machine and 60 s to each interpreter slice.
DEFAULT_BUDGET_S = 420.0
# What --exclude may name: a CaseSpec field, or the extent its sizes make (`CaseSpec.extent`).
EXCLUDABLE = (*CaseSpec.__dataclass_fields__, "extent")


@dataclass(frozen=True)
class CampaignConfig:
    """One campaign: the implementation ``impl`` (a registry name or ``module:function``; lce's
    own backends are its adapter's) at ``backends`` (empty: every backend it has that runs here)
    x ``tp_sizes`` (those above 1 only if it claims TP), searched under ``profile`` within
    ``budget_s``. ``max_examples`` overrides the profile's per-slice example count;
    ``example_deadline_s`` fixes the per-example deadline instead of the profile's rule
    (`verify.execution.deadline`)."""

    impl: str = "lce"
    profile: str = "ci"
    backends: tuple[str, ...] = ()
    tp_sizes: tuple[int, ...] = (1, 2, 4)
    budget_s: float = DEFAULT_BUDGET_S
    out_dir: Path = Path("results/campaign")
    failures_dir: Path | None = None  # default: out_dir / "failures"
    properties: tuple[str, ...] = ()  # empty: every property that applies
    device: str = "cpu"
    seed: int | None = None
    mutant: str | None = None
    max_examples: int | None = None
    dtypes: tuple[str, ...] = ()  # tolerances.yaml dtype keys (fp32, bf16, fp32_bf16, ...); all
    # Concurrent searches per TP=1 slice (`verify.running.concurrent_searches`); None: its default
    # (several on CUDA, 1 on the CPU). TP > 1 slices run one search.
    searches: int | None = None
    example_deadline_s: float | None = None  # None: the profile's
    # "field=value" pairs of CaseSpec: specs with any of them are not drawn (a region with an
    # open, reported finding that would otherwise end every search first)
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_dir", Path(self.out_dir))  # a str works too
        if self.failures_dir is not None:
            object.__setattr__(self, "failures_dir", Path(self.failures_dir))

    def excluded(self, spec: CaseSpec) -> bool:
        """``spec`` lies in a region `exclude` leaves out."""
        return any(str(getattr(spec, field)) == value for field, value in self._exclusions())

    def _exclusions(self) -> list[tuple[str, str]]:
        pairs = [item.partition("=") for item in self.exclude]
        return [(field, value) for field, _, value in pairs]

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

    def example_deadline(self) -> ExampleDeadline:
        """A search's per-example deadline: fixed at the option, else the profile's rule."""
        if self.example_deadline_s is not None:
            return ExampleDeadline(self.example_deadline_s, fixed=True)
        return ExampleDeadline(example_deadline_floor(self.profile))

    def searches_at(self, tp: int) -> int:
        """How many searches a slice at TP degree ``tp`` runs at once (TP > 1: one)."""
        if tp != 1:
            return 1
        return self.searches or default_count(self.device, tp)

    def extents_at(self, backend: str) -> tuple[str, ...]:
        """The extents (`verify.cases.spec.EXTENTS`) a slice of ``backend`` runs: all but where
        Triton runs in its interpreter (on the CPU), where a wide case's one run takes seconds
        (3.3 s on 2 cores, against 0.01 s on the torch backend)."""
        return ("small",) if backend == "triton" and self.device == "cpu" else EXTENTS

    def validate(self) -> None:
        """Raise ValueError naming the bad option and the fix."""
        profile_settings(self.profile)  # unknown profile: the profiles module names the choices
        for backend in self.backends:
            if backend not in BACKENDS:
                raise ValueError(f"--backends: unknown backend {backend!r}; choose from {BACKENDS}")
        for tp in self.tp_sizes:
            if tp not in TP_DEGREES:
                raise ValueError(f"--tp: TP degree must be one of 1, 2, 4, 8, got {tp}")
        if not self.tp_sizes:
            raise ValueError("--tp needs at least one value")
        if self.on_gpu:
            _check_gpus(max(self.tp_sizes))
        if self.searches is not None and self.searches < 1:
            raise ValueError(f"--searches must be >= 1, got {self.searches}")
        if not self.budget_s > 0:
            raise ValueError(f"--budget-s must be > 0 seconds, got {self.budget_s}")
        if self.example_deadline_s is not None and not self.example_deadline_s > 0:
            raise ValueError(
                f"--example-deadline-s must be > 0 seconds, got {self.example_deadline_s}"
            )
        for dtype in self.dtypes:
            if dtype not in PAIR_OF:
                raise ValueError(f"--dtypes: unknown {dtype!r}; choose from {', '.join(PAIR_OF)}")
        for name in self.properties:
            if name not in PROPERTIES:
                raise ValueError(f"--properties: unknown {name!r}; known: {', '.join(PROPERTIES)}")
        for field, value in self._exclusions():
            if field not in EXCLUDABLE or not value:
                raise ValueError(
                    f"--exclude: {field}={value} is not FIELD=VALUE with a CaseSpec field; "
                    f"fields: {', '.join(EXCLUDABLE)}"
                )
            if field == "extent" and value not in EXTENTS:
                raise ValueError(f"--exclude: extent={value}; extents: {', '.join(EXTENTS)}")
        if self.mutant is not None and self.mutant not in MUTANTS:
            raise ValueError(f"--mutant: unknown {self.mutant!r}; known: {', '.join(MUTANTS)}")


def _check_gpus(tp: int) -> None:
    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ValueError("--device cuda but no GPU is visible; use --device cpu (gloo)")
    if tp > gpus:
        usable = ",".join(str(t) for t in TP_DEGREES if t <= gpus)
        raise ValueError(f"--tp {tp} needs one GPU per rank; {gpus} visible (use --tp {usable})")


def default_count(device: str, tp: int, cores: int | None = None) -> int:
    """Searches per slice when the campaign names none: on CUDA at TP=1, three per four cores,
    at most 12 (a search's driver idles while its worker compiles a kernel, the single-threaded
    step most examples wait on); elsewhere 1 (the CPU campaign's cores are its workers' already,
    and a TP > 1 slice's ranks own every GPU)."""
    if device != "cuda" or tp != 1:
        return 1
    return max(1, min(12, (cores or os.cpu_count() or 2) * 3 // 4))
