"""The search `zbench tune` runs for one case: which batch geometry to try next, given the trials so far.

Pure logic on trial results (no process is started here), in the order an engineer would go:

1. the training micro-batch, starting from the case's own (or the largest the memory model says fits): grow while
   it fits and the step gets faster; when growing did not help, shrink while that helps; when the start was over
   budget, shrink until it fits, unless the memory model says no smaller micro-batch can save enough;
2. activation checkpointing, only where memory stopped the growth (it buys memory with recomputation, so it cannot
   win where speed stopped it): larger micro-batches with it, while faster; then, where checkpointing every decoder
   layer won, checkpointing only as many as the budget needs (the rest keep their activations and skip the
   recomputation);
   where the layers are compiled and checkpointing may be off, the activation budget instead of fewer
   checkpointed layers: where memory stopped the growth, larger micro-batches at the largest budget predicted to
   fit them, while faster; then, at the best micro-batch, no layer checkpointed and the largest budget above its
   own predicted to fit, and from each such trial on, above it where it fitted or below it where it did not (the
   compiler recomputes the rest inside the layer's backward, which costs less than checkpointing the same memory
   away);
3. the forward micro-batch of the gradient-free passes, only when those passes take a share of the step worth
   winning: grow from the training micro-batch while faster.

Predictions are the memory model's (`zbench.analyze.activations`), calibrated by what the case's trials measured
(`calibrate`). Where a trial measures each phase (on a GPU: memory in use at the end of the rollout and of
training), each phase is calibrated on its own and the larger is the peak; a CPU's one figure is calibrated whole.
One trial shifts the model by what it measured above it (the runtime, allocator and interpreter no formula holds);
between trials the prediction follows the line through their measurements, and past them the slope they show where
their model figures lie 2 GB apart or more (`SLOPE_SPREAD_GB`), taken along one knob at a time where trials differ
from the prediction in that knob alone (`Search.calibrating`). The model counts every sequence at full length: at GRPO's
reference config it grows the training phase by 8.6 GB from activation budget 0.05 to 0.2, where an H200 measured
4.9 (results/reference/h200x2-dense-20261128), so a shift alone keeps the search from budgets that fit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace

OK, OVER_BUDGET = "ok", "over_budget"
# `calibrate`: trials whose model figures lie closer than this tell no slope apart from the measurements' noise
SLOPE_SPREAD_GB = 2.0
SLOPES = (0.25, 2.0)  # the measured-over-model slope a calibration may take, at least and at most
# `Search.calibrating`: the knobs along which trials calibrate a prediction (the budget search's, the micro-batch
# search's, the forward micro-batch's, the checkpointed layers'), in this order where several could
PEER_KNOBS = ("activation_budget", "train_micro", "forward_micro", "checkpoint_layers")
MEMORY_STATUSES = (OVER_BUDGET, "oom")  # the trial ran out of the budget (or of the device)
TOLERANCE = 0.03  # a step must be this much faster to count as faster: the noise of a few timed steps
# of the trials the timed steps cannot tell apart, those less than this share of the memory budget above the one
# that needs the least count as needing as little, and the fastest of them is chosen: a saving that small is not
# worth the speed a user gives up (the recorded GRPO tune chose 24.67 GB over 24.70 GB whose updates took 1.7 % less
# time; 2 % of its 28 GB budget is 0.56 GB)
MEMORY_TIE = 0.02
MAX_TRIALS = 10  # per case: a search that has not settled by then is stopped, with a note


@dataclass(frozen=True, slots=True)
class Geometry:
    """The batch knobs of one trial."""

    train_micro: int  # sequences per forward/backward on one rank (actor, and critic with PPO)
    forward_micro: int  # sequences per gradient-free forward on one rank; 0: as the training micro-batch
    checkpointing: bool  # activation checkpointing
    checkpoint_layers: int | None = None  # with checkpointing: the decoder layers that recompute (None: every one)
    # compiled layers: the share of their activations they keep (`model.activation_memory_budget`); None: not tuned
    activation_budget: float | None = None

    def label(self) -> str:
        """Short text for logs and plots: `micro 4, fwd 8, ckpt` (`ckpt 20 layers` where not every one; `budget 0.3`
        where the layers that keep activations keep that share)."""
        fwd = f", fwd {self.forward_micro}" if self.forward_micro else ""
        layers = f" {self.checkpoint_layers} layers" if self.checkpoint_layers is not None else ""
        kept = self.activation_budget is not None and (not self.checkpointing or self.checkpoint_layers is not None)
        budget = f", budget {self.activation_budget:g}" if kept else ""
        return f"micro {self.train_micro}{fwd}{f', ckpt{layers}' if self.checkpointing else ''}{budget}"


@dataclass(frozen=True, slots=True)
class Phases:
    """GB in use by the two phases that take turns with the memory: the rollout (its KV cache) and training (the
    passes' activations and logits). The case's peak is the larger, unless something peaks in between."""

    gen: float
    train: float


@dataclass(frozen=True, slots=True)
class TrialResult:
    """What a trial measured, as steady means: `step_s` of `timing_s/step`, `forward_s` of its gradient-free passes,
    `geometry_s` of the phases batch geometry changes (the updates and the gradient-free passes)."""

    geometry: Geometry
    status: str  # ok, over_budget, oom, failed, timeout, stopped
    step_s: float | None = None
    peak_gb: float | None = None
    forward_s: float | None = None
    geometry_s: float | None = None
    phases: Phases | None = None  # each phase's memory, where the trial measured them


@dataclass(frozen=True, kw_only=True)
class Space:
    """What may be tried for one case, and the memory model's view of it."""

    train_micros: tuple[int, ...]  # ascending; one value when the user fixed it
    forward_micros: tuple[int, ...]  # ascending candidates above nothing yet; () when fixed or none divides
    checkpointing: tuple[bool, ...]  # (False, True), or the one value the user fixed
    start: Geometry
    budget_gb: float
    predict_gb: Callable[[Geometry], float]  # the memory model's per-rank (CPU: per-host) peak
    # the memory model's per-phase figures, where the trials measure phases (a GPU); None: the peak is calibrated whole
    predict_phases: Callable[[Geometry], Phases] | None = None
    num_layers: int = 0  # decoder layers, where checkpointing fewer of them may be tried (0: it may not)
    budgets: tuple[float, ...] = ()  # ascending activation budgets to try, where the layers compile (): not tuned
    tolerance: float = TOLERANCE
    max_trials: int = MAX_TRIALS


@dataclass
class Search:
    """One case's search: `plan()` yields geometries and is sent each trial's result; `notes` say what was pruned."""

    space: Space
    trials: list[TrialResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- what the trials say

    def calibrating(self, g: Geometry) -> list[TrialResult]:
        """The trials that calibrate the memory model's prediction for `g`: those that measured what is calibrated
        (each phase where the model gives phases and they measured them, else the peak), and of those, the ones
        that differ from `g` in one knob alone (`PEER_KNOBS`): the first knob whose trials show a slope (model
        figures `SLOPE_SPREAD_GB` apart), else the first with any; with no such trial, those that checkpoint as
        `g` does, else all. The model errs by different amounts along different knobs (at GRPO's reference config,
        training grew 0.57 GB a GB the model added along the activation budget, 1.22 along the micro-batch), so a
        slope is taken along the knob that moves."""
        phased = self.space.predict_phases is not None and any(t.phases is not None for t in self.trials)
        measured = [t for t in self.trials if (t.phases if phased else t.peak_gb) is not None]
        knobs = [peers for knob in PEER_KNOBS
                 if (peers := [t for t in measured if replace(t.geometry, **{knob: getattr(g, knob)}) == g])]
        sloped = [peers for peers in knobs if self._spread(peers, phased) >= SLOPE_SPREAD_GB]
        if sloped or knobs:
            return (sloped or knobs)[0]
        return [t for t in measured if t.geometry.checkpointing == g.checkpointing] or measured

    def _spread(self, trials: list[TrialResult], phased: bool) -> float:
        """How far apart the memory model puts `trials`, in the figure that spreads them most (a phase, or the
        peak)."""
        if phased and self.space.predict_phases is not None:
            figures = [self.space.predict_phases(t.geometry) for t in trials]
            return max(max(f.gen for f in figures) - min(f.gen for f in figures),
                       max(f.train for f in figures) - min(f.train for f in figures))
        peaks = [self.space.predict_gb(t.geometry) for t in trials]
        return max(peaks) - min(peaks)

    def predicted_gb(self, g: Geometry) -> float:
        """The memory model's peak for `g`, calibrated by what the trials measured (`calibrate`, on the trials of
        `calibrating`): phase by phase where the trials measured phases, plus the most any of them peaked above
        both of its phases."""
        s, trials = self.space, self.calibrating(g)
        if not trials or trials[0].phases is None or s.predict_phases is None:
            return calibrate([(s.predict_gb(t.geometry), t.peak_gb) for t in trials], s.predict_gb(g))
        model = s.predict_phases(g)
        models = [s.predict_phases(t.geometry) for t in trials]
        gen = calibrate([(m.gen, t.phases.gen) for m, t in zip(models, trials, strict=True)], model.gen)
        train = calibrate([(m.train, t.phases.train) for m, t in zip(models, trials, strict=True)], model.train)
        between = max(t.peak_gb - max(t.phases.gen, t.phases.train) for t in trials)
        return max(gen, train) + max(0.0, between)

    def fits(self, g: Geometry) -> bool:
        """Whether `g` is predicted to stay within the budget."""
        return self.predicted_gb(g) <= self.space.budget_gb

    def ranked_s(self, t: TrialResult) -> float | None:
        """The time the case's trials are compared on, one measure for all of them: the phases geometry changes
        (`geometry_s`) where every trial that ran measured them, else the whole step."""
        ran = [r for r in self.trials if r.status == OK and r.step_s is not None]
        by_phases = all(r.geometry_s is not None for r in ran) and t.geometry_s is not None
        return t.geometry_s if by_phases else t.step_s

    def best(self) -> TrialResult | None:
        """The fastest trial within the budget (`ranked_s`); of those within the tolerance of the fastest (which a
        few timed steps cannot tell apart), the fastest of those less than `MEMORY_TIE` of the memory budget above
        the least memory among them: a trial is chosen for its memory only where it saves a material amount."""
        ok = [(t, v) for t in self.trials if t.status == OK and (v := self.ranked_s(t)) is not None]
        if not ok:
            return None
        fastest = min(v for _, v in ok)

        def peak(t: TrialResult) -> float:
            return t.peak_gb if t.peak_gb is not None else math.inf

        close = [(t, v) for t, v in ok if v <= fastest * (1 + self.space.tolerance)]
        least = min(peak(t) for t, _ in close)
        lean = [(t, v) for t, v in close if peak(t) - least < MEMORY_TIE * self.space.budget_gb]
        return min(lean, key=lambda tv: (tv[1], peak(tv[0])))[0]

    def faster(self, r: TrialResult, than: TrialResult | None) -> bool:
        """Whether `r` ran within budget and beat `than` by more than the tolerance (`ranked_s`)."""
        mine = self.ranked_s(r) if r.status == OK else None
        if mine is None:
            return False
        theirs = self.ranked_s(than) if than is not None else None
        return theirs is None or mine < theirs * (1 - self.space.tolerance)

    # ---------------------------------------------------------------- the plan

    def _trial(self, g: Geometry) -> Generator[Geometry, TrialResult, TrialResult | None]:
        if any(t.geometry == g for t in self.trials):
            return next(t for t in self.trials if t.geometry == g)
        if len(self.trials) >= self.space.max_trials:
            self.notes.append(f"stopped at {self.space.max_trials} trials (the most per case)")
            return None
        result = yield g
        self.trials.append(result)
        return result

    def _prune(self, g: Geometry) -> bool:
        """Note and skip `g` when it is predicted over budget."""
        if self.fits(g):
            return False
        self.notes.append(f"{g.label()}: not tried, predicted {self.predicted_gb(g):.2f} GB > budget "
                          f"{self.space.budget_gb:.2f} GB")
        return True

    def plan(self) -> Generator[Geometry, TrialResult, None]:
        """The geometries to try, one at a time; send each one's result back."""
        s = self.space
        micros = s.train_micros
        ckpt0 = False if False in s.checkpointing else s.checkpointing[0]
        fwd0 = s.start.forward_micro if not s.forward_micros else 0

        def at(m: int, ckpt: bool = ckpt0) -> Geometry:
            return Geometry(m, fwd0, ckpt, activation_budget=s.start.activation_budget)

        fitting = [m for m in micros if self.fits(at(m))]
        if not fitting:
            frugal = at(micros[0], ckpt=True in s.checkpointing)
            self.notes.append(f"no geometry is predicted to fit: the smallest, {frugal.label()}, needs "
                              f"{self.predicted_gb(frugal):.2f} GB > budget {s.budget_gb:.2f} GB; tried once to "
                              "measure it")
            yield from self._trial(frugal)
            return
        start = s.start.train_micro if s.start.train_micro in fitting else max(fitting)
        first = yield from self._trial(at(start))
        if first is None:
            return
        stopped_by = "memory" if first.status in MEMORY_STATUSES else "speed"
        if first.status == OK:
            stopped_by = yield from self._grow(micros[micros.index(start) + 1:], at)
            if not any(self.faster(t, first) for t in self.trials if t is not first):  # growing did not pay
                yield from self._improve_down(list(reversed(micros[:micros.index(start)])), at)
        elif stopped_by == "memory":
            yield from self._shrink(list(reversed(micros[:micros.index(start)])), at, first)
        else:
            self.notes.append(f"{first.geometry.label()}: {first.status}; the search stops at a geometry that does "
                              "not run for another reason than memory")
            return
        yield from self._checkpointing(stopped_by)
        if s.budgets and False in s.checkpointing:  # the budget acts on layers checkpointing leaves alone
            yield from self._larger_within_budget(stopped_by)
            yield from self._budget()
        else:
            yield from self._fewer_checkpointed()
        yield from self._forward()

    def _grow(self, larger: list[int], at: Callable[[int], Geometry]) -> Generator[Geometry, TrialResult, str]:
        """Larger training micro-batches while they fit and are faster; returns what stopped the growth: "memory",
        "speed" (not faster, or not run), or "end" (no larger micro-batch divides the mini-batch)."""
        for m in larger:
            if self._prune(at(m)):
                return "memory"
            best = self.best()
            r = yield from self._trial(at(m))
            if r is None:
                return "speed"
            if r.status in MEMORY_STATUSES:
                return "memory"
            if not self.faster(r, best):
                return "speed"
        return "end"

    def _improve_down(self, smaller: list[int], at: Callable[[int], Geometry]
                      ) -> Generator[Geometry, TrialResult, None]:
        """Smaller training micro-batches while they are faster (a larger one was not)."""
        for m in smaller:
            best = self.best()
            r = yield from self._trial(at(m))
            if r is None or not self.faster(r, best):
                return

    def _shrink(self, smaller: list[int], at: Callable[[int], Geometry], over: TrialResult
                ) -> Generator[Geometry, TrialResult, None]:
        """Smaller training micro-batches until one fits, unless none can: the measured peak less what the memory
        model says the smaller micro-batch saves is still over budget."""
        for m in smaller:
            g = at(m)
            if over.peak_gb is not None:
                saving = self.space.predict_gb(over.geometry) - self.space.predict_gb(g)
                if over.peak_gb - saving > self.space.budget_gb:
                    self.notes.append(f"{over.geometry.label()} measured {over.peak_gb:.2f} GB; {g.label()} saves "
                                      f"{saving:.2f} GB by the memory model, still over budget "
                                      f"{self.space.budget_gb:.2f} GB: no smaller micro-batch tried")
                    return
            r = yield from self._trial(g)
            if r is None or r.status == OK:
                return
            if r.status not in MEMORY_STATUSES:
                return
            over = r

    def _checkpointing(self, stopped_by: str) -> Generator[Geometry, TrialResult, None]:
        """Activation checkpointing at larger micro-batches, where memory stopped the growth."""
        if True not in self.space.checkpointing or False not in self.space.checkpointing:
            return
        best = self.best()
        if stopped_by != "memory" and best is not None:
            why = ("no larger micro-batch divides the mini-batch" if stopped_by == "end"
                   else "speed, not memory, stopped the micro-batch's growth")
            self.notes.append(f"checkpointing: not tried; it buys memory with recomputation, and {why}")
            return
        floor = best.geometry.train_micro if best else 0
        for m in [m for m in self.space.train_micros if m > floor or best is None]:
            g = Geometry(m, best.geometry.forward_micro if best else self.space.start.forward_micro, True,
                         activation_budget=self.space.start.activation_budget)
            if self._prune(g):
                return
            r = yield from self._trial(g)
            if r is None or not self.faster(r, best):
                return
            best = r

    def _fewer_checkpointed(self, attempts: int = 3) -> Generator[Geometry, TrialResult, None]:
        """Where the best geometry checkpoints every layer: the fewest checkpointed layers predicted to fit the budget
        (the memory model, corrected by what the trials measured); after a trial over budget, the fewest predicted
        to fit with that trial's measurement counted, `attempts` trials at most. The trials compete with the rest."""
        best, layers = self.best(), self.space.num_layers
        if best is None or layers <= 0 or not best.geometry.checkpointing or best.geometry.checkpoint_layers is not None:
            return
        tried = -1
        for _ in range(attempts):
            fitting = [k for k in range(tried + 1, layers) if self.fits(replace(best.geometry, checkpoint_layers=k))]
            if not fitting:
                self.notes.append(f"checkpointing fewer layers: {best.geometry.label()} is predicted over budget "
                                  f"even with {layers - 1} of {layers} layers checkpointed" if tried < 0 else
                                  f"checkpointing fewer layers: no count above {tried} of {layers} is predicted to "
                                  f"fit after its trial ran over budget")
                return
            tried = fitting[0]
            r = yield from self._trial(replace(best.geometry, checkpoint_layers=tried))
            if r is None or r.status not in MEMORY_STATUSES:
                return

    def _lean(self, micro: int, above: float = -1.0, below: float = float("inf")) -> Geometry | None:
        """The best geometry at `micro` with no layer checkpointed and the largest activation budget strictly
        between `above` and `below` predicted to fit (the memory model, corrected by what the trials measured);
        None if none is."""
        best = self.best()
        base = replace(best.geometry if best else self.space.start, train_micro=micro, checkpointing=False,
                       checkpoint_layers=None)
        fitting = [b for b in self.space.budgets if above < b < below and self.fits(replace(base, activation_budget=b))]
        return replace(base, activation_budget=max(fitting)) if fitting else None

    def _larger_within_budget(self, stopped_by: str) -> Generator[Geometry, TrialResult, None]:
        """Where memory stopped the micro-batch's growth: larger micro-batches, each at the largest activation
        budget predicted to fit it (a lower one than the case started with, where that is what fits), while
        faster."""
        best = self.best()
        if stopped_by != "memory" or best is None:
            return
        for m in [m for m in self.space.train_micros if m > best.geometry.train_micro]:
            g = self._lean(m)
            if g is None:
                self.notes.append(f"activation budget: micro {m} is predicted over {self.space.budget_gb:.2f} GB at "
                                  f"every budget tried ({', '.join(f'{b:g}' for b in self.space.budgets)})")
                return
            r = yield from self._trial(g)
            if r is None or not self.faster(r, best):
                return
            best = r

    def _budget(self, attempts: int = 3) -> Generator[Geometry, TrialResult, None]:
        """Where the layers compile: the best geometry's micro-batch with no layer checkpointed and the largest
        activation budget above its own predicted to fit; then, with that trial's measurement counted, the largest
        predicted to fit above it (it fitted) or below it (it ran over budget), `attempts` trials at most. The
        trials compete with the rest."""
        best = self.best()
        if best is None:
            return
        own = None if best.geometry.checkpointing else best.geometry.activation_budget
        above, below = (-1.0 if own is None else own), float("inf")
        for _ in range(attempts):
            g = self._lean(best.geometry.train_micro, above, below)
            if g is None:
                what = "no budget" if above < 0 else f"no budget above {above:g}"
                self.notes.append(f"activation budget: {what}{f' and below {below:g}' if below < 1.5 else ''} is "
                                  f"predicted to fit micro {best.geometry.train_micro} within "
                                  f"{self.space.budget_gb:.2f} GB")
                return
            r = yield from self._trial(g)
            if r is None or r.status not in (OK, *MEMORY_STATUSES):
                return
            if r.status == OK:
                above = g.activation_budget or 0.0
            else:
                below = g.activation_budget or 0.0

    def _forward(self) -> Generator[Geometry, TrialResult, None]:
        """Larger forward micro-batches for the gradient-free passes, when they take a share worth winning."""
        best = self.best()
        if best is None or not self.space.forward_micros:
            return
        larger = [f for f in self.space.forward_micros if f > best.geometry.train_micro]
        if not larger:
            self.notes.append(f"forward micro-batch: none larger than the training micro-batch "
                              f"({best.geometry.train_micro}) divides a rank's sequences")
            return
        ranked = self.ranked_s(best)
        if best.forward_s is not None and ranked and best.forward_s < self.space.tolerance * ranked:
            of = "the updates' and passes'" if ranked == best.geometry_s else "a step's"
            self.notes.append(f"forward micro-batch: not tried; the gradient-free passes take {best.forward_s:.3f} s "
                              f"of {of} {ranked:.3f} s, less than tuning can tell from noise")
            return
        for f in larger:
            g = replace(best.geometry, forward_micro=f)
            if self._prune(g):
                return
            r = yield from self._trial(g)
            if r is None or not self.faster(r, best):
                return
            best = r


def calibrate(points: list[tuple[float, float]], x: float) -> float:
    """What a trial would measure where the memory model says `x` GB, from the (model, measured) GB of the trials
    that ran. With none: `x`. Between two trials' model figures: on the line through their measurements. Elsewhere:
    from the nearest trial, along the slope the trials show (least squares, within `SLOPES`) where their model
    figures spread over `SLOPE_SPREAD_GB` or more, else along the model's own (a shift by what was measured above
    it). Trials at one model figure count as the largest they measured."""
    if not points:
        return x
    largest: dict[float, float] = {}
    for px, py in points:
        largest[px] = max(py, largest.get(px, -math.inf))
    xs = sorted(largest)
    for lo, hi in itertools.pairwise(xs):
        if lo <= x <= hi:
            return largest[lo] + (largest[hi] - largest[lo]) * (x - lo) / (hi - lo)
    slope = 1.0
    if xs[-1] - xs[0] >= SLOPE_SPREAD_GB:
        mx, my = sum(xs) / len(xs), sum(largest.values()) / len(xs)
        fitted = sum((px - mx) * (largest[px] - my) for px in xs) / sum((px - mx) ** 2 for px in xs)
        slope = min(max(fitted, SLOPES[0]), SLOPES[1])
    near = xs[-1] if x > xs[-1] else xs[0]
    return largest[near] + slope * (x - near)


def divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n`, ascending."""
    return tuple(d for d in range(1, n + 1) if n % d == 0)
