"""The tune's search on hand-made trial results: what it tries, in which order, and what it prunes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from zbench.harness.tune import out_of_time
from zbench.harness.tune_search import (
    MEMORY_TIE,
    OK,
    OVER_BUDGET,
    SLOPES,
    Geometry,
    Phases,
    Search,
    Space,
    TrialResult,
    calibrate,
    divisors,
)


def space(budget: float = 100.0, predict: Callable[[Geometry], float] = lambda g: 1.0, start: int = 2,
          micros: tuple[int, ...] = (1, 2, 4, 8, 16), forwards: tuple[int, ...] = (),
          checkpointing: tuple[bool, ...] = (False, True), max_trials: int = 10) -> Space:
    return Space(train_micros=micros, forward_micros=forwards, checkpointing=checkpointing,
                 start=Geometry(start, 0, False), budget_gb=budget, predict_gb=predict, max_trials=max_trials)


def drive(s: Space, world: Callable[[Geometry], TrialResult]) -> Search:
    """Run the search against a table of outcomes, as the tuner runs it against real trials."""
    search = Search(s)
    plan = search.plan()
    g = next(plan, None)
    while g is not None:
        try:
            g = plan.send(world(g))
        except StopIteration:
            g = None
    return search


def timed(steps: dict[int, float], peak: Callable[[Geometry], float] = lambda g: 1.0, forward_s: float = 0.0
          ) -> Callable[[Geometry], TrialResult]:
    return lambda g: TrialResult(g, OK, steps[g.train_micro], peak(g), forward_s)


def tried(search: Search) -> list[tuple[int, int, bool]]:
    return [(t.geometry.train_micro, t.geometry.forward_micro, t.geometry.checkpointing) for t in search.trials]


def test_grows_while_faster_and_stops_at_the_first_slower_step() -> None:
    search = drive(space(start=2), timed({2: 1.0, 4: 0.8, 8: 0.7, 16: 0.75}))
    assert tried(search) == [(2, 0, False), (4, 0, False), (8, 0, False), (16, 0, False)]
    assert search.best().geometry == Geometry(8, 0, False)
    assert any("speed, not memory" in n for n in search.notes)  # checkpointing cannot win: pruned


def test_a_step_within_the_noise_does_not_count_as_faster() -> None:
    search = drive(space(start=2), timed({2: 1.0, 4: 0.99, 8: 0.5, 1: 1.2}))  # 1 % is within the 3 % tolerance
    assert tried(search) == [(2, 0, False), (4, 0, False), (1, 0, False)]  # growing did not pay: 1 is tried


def test_shrinks_when_growing_did_not_help() -> None:
    search = drive(space(start=4), timed({4: 1.0, 8: 1.1, 2: 0.9, 1: 0.95}))
    assert tried(search) == [(4, 0, False), (8, 0, False), (2, 0, False), (1, 0, False)]
    assert search.best().geometry.train_micro == 2


def test_a_micro_batch_predicted_over_budget_is_not_tried_and_checkpointing_buys_it() -> None:
    # 1 GB per sequence without checkpointing, a quarter of that with it; the budget holds 10
    def predict(g: Geometry) -> float:
        return g.train_micro * (0.25 if g.checkpointing else 1.0)

    steps = {(2, False): 1.0, (4, False): 0.8, (8, False): 0.7, (16, True): 0.6}
    search = drive(space(budget=10, predict=predict),
                   lambda g: TrialResult(g, OK, steps[(g.train_micro, g.checkpointing)], predict(g)))
    assert tried(search) == [(2, 0, False), (4, 0, False), (8, 0, False), (16, 0, True)]
    assert any(n.startswith("micro 16: not tried, predicted 16.00 GB > budget 10.00 GB") for n in search.notes)
    assert search.best().geometry == Geometry(16, 0, True)


def test_where_checkpointing_won_fewer_layers_are_checkpointed_as_the_budget_allows() -> None:
    """Micro-batch 16 fits only with checkpointing (4 of its 16 GB kept with every one of 8 layers checkpointed;
    each layer that keeps its activations adds 1.5 GB): the fewest checkpointed layers predicted to fit the 10 GB
    budget come next (4: 4 + 4 x 1.5), and when that trial measures over budget, the fewest predicted to fit with
    its measurement counted (5). Each layer spared its recomputation makes the update faster."""

    def predict(g: Geometry) -> float:
        if not g.checkpointing:
            return float(g.train_micro)
        kept = 8 - (8 if g.checkpoint_layers is None else g.checkpoint_layers)
        return g.train_micro * 0.25 + kept * 1.5

    def world(g: Geometry) -> TrialResult:
        if not g.checkpointing:
            return TrialResult(g, OK, {2: 1.0, 4: 0.8, 8: 0.7}[g.train_micro], predict(g))
        if g.checkpoint_layers is None:
            return TrialResult(g, OK, 0.6, predict(g))
        measured = predict(g) + (1.0 if g.checkpoint_layers == 4 else 0.0)  # longer batches than the model's
        status = OK if measured <= 10 else OVER_BUDGET
        return TrialResult(g, status, 0.6 - 0.02 * (8 - g.checkpoint_layers), measured)

    search = drive(Space(train_micros=(2, 4, 8, 16), forward_micros=(), checkpointing=(False, True),
                         start=Geometry(2, 0, False), budget_gb=10.0, predict_gb=predict, num_layers=8), world)
    assert [t.geometry for t in search.trials][-3:] == [
        Geometry(16, 0, True), Geometry(16, 0, True, 4), Geometry(16, 0, True, 5)]
    assert search.trials[-2].status == OVER_BUDGET and search.best().geometry == Geometry(16, 0, True, 5)
    assert search.best().geometry.label() == "micro 16, ckpt 5 layers"
    # where the layer count is fixed (num_layers 0), or no checkpointed geometry won, nothing more is tried
    fixed = drive(Space(train_micros=(2, 4, 8, 16), forward_micros=(), checkpointing=(False, True),
                        start=Geometry(2, 0, False), budget_gb=10.0, predict_gb=predict), world)
    assert all(t.geometry.checkpoint_layers is None for t in fixed.trials)
    plain = drive(space(start=2), timed({2: 1.0, 4: 0.8, 8: 0.7, 16: 0.75}))
    assert all(t.geometry.checkpoint_layers is None for t in plain.trials)


def test_where_layers_compile_the_largest_activation_budget_predicted_to_fit_is_tried() -> None:
    """Compiled layers keep a share of their activations (the budget) instead of checkpointing fewer layers: from
    the best micro-batch at the case's own budget, the largest budget predicted to fit comes next; when that trial
    measures over budget, the largest below it predicted to fit with its measurement counted. Fewer checkpointed
    layers are not tried then (the budget buys the same memory for less recomputation)."""

    def predict(g: Geometry) -> float:
        kept = 0.25 if g.checkpointing else 0.25 + 0.75 * (g.activation_budget or 0.0)
        return 2.0 + g.train_micro * kept

    def world(g: Geometry) -> TrialResult:
        measured = predict(g) + (3.0 if g.activation_budget == 1.0 else 0.0)  # the model undercounts there
        step = (1.0 - 0.3 * (g.activation_budget or 0.0) if not g.checkpointing else 1.1) * (8 / g.train_micro)
        return TrialResult(g, OK if measured <= 12 else OVER_BUDGET, step, measured)

    start = Geometry(8, 0, False, activation_budget=0.05)
    search = drive(Space(train_micros=(2, 4, 8), forward_micros=(), checkpointing=(False, True), start=start,
                         budget_gb=12.0, predict_gb=predict, num_layers=8, budgets=(0.0, 0.15, 0.3, 0.5, 1.0)), world)
    assert [t.geometry for t in search.trials] == [start, Geometry(4, 0, False, activation_budget=0.05),
                                                   Geometry(8, 0, False, activation_budget=1.0),
                                                   Geometry(8, 0, False, activation_budget=0.5)]
    assert search.trials[2].status == OVER_BUDGET
    assert search.best().geometry.label() == "micro 8, budget 0.5"
    # checkpointing fixed on: no trial turns it off (the budget would act on no layer); fewer layers are tried
    ckpt = drive(Space(train_micros=(8,), forward_micros=(), checkpointing=(True,), start=Geometry(8, 0, True),
                       budget_gb=4.5, predict_gb=predict, num_layers=8, budgets=(0.0, 0.15, 0.3)), world)
    assert all(t.geometry.checkpointing for t in ckpt.trials)


def test_where_memory_stops_the_growth_larger_micro_batches_are_tried_at_lower_budgets() -> None:
    """Checkpointing fixed off, the case's budget 1: micro-batch 8 is the largest that fits at it. Larger ones come
    next, each at the largest budget predicted to fit it, while faster; then no budget above the best's fits."""

    def predict(g: Geometry) -> float:
        return 2.0 + g.train_micro * (0.25 + 0.75 * (g.activation_budget or 0.0))

    def world(g: Geometry) -> TrialResult:
        return TrialResult(g, OK, (1.0 - 0.3 * (g.activation_budget or 0.0)) * 8 / g.train_micro, predict(g))

    search = drive(Space(train_micros=(8, 16, 32), forward_micros=(), checkpointing=(False,),
                         start=Geometry(32, 0, False, activation_budget=1.0), budget_gb=12.0, predict_gb=predict,
                         budgets=(0.0, 0.15, 0.3, 0.5, 1.0)), world)
    assert [t.geometry for t in search.trials] == [Geometry(8, 0, False, activation_budget=1.0),
                                                   Geometry(16, 0, False, activation_budget=0.5),
                                                   Geometry(32, 0, False, activation_budget=0.0)]
    assert search.best().geometry.label() == "micro 32, budget 0"
    assert "activation budget: no budget above 0 is predicted to fit micro 32 within 12.00 GB" in search.notes


def test_what_a_trial_measured_above_the_model_corrects_the_prediction() -> None:
    # the model says 1 GB per sequence; the trials measure 5 GB more (runtime, allocator): 8 then cannot fit in 10
    search = drive(space(budget=10, predict=lambda g: float(g.train_micro), checkpointing=(False,)),
                   timed({2: 1.0, 4: 0.8}, peak=lambda g: g.train_micro + 5.0))
    assert tried(search) == [(2, 0, False), (4, 0, False)]
    assert search.predicted_gb(Geometry(8, 0, False)) == 13.0
    assert any("micro 8: not tried, predicted 13.00 GB" in n for n in search.notes)


def test_calibrate_shifts_by_one_trial_and_takes_the_slope_two_show() -> None:
    assert calibrate([], 7.0) == 7.0  # nothing measured: the model
    assert calibrate([(10.0, 13.0)], 20.0) == 23.0  # one trial: the model shifted by what it measured above it
    assert calibrate([(10.0, 13.0), (10.0, 14.0)], 12.0) == 16.0  # one model figure: the largest measurement
    # between two trials: on the line through them; past them, along the slope they show
    points = [(10.0, 20.0), (20.0, 25.0)]
    assert calibrate(points, 15.0) == 22.5
    assert calibrate(points, 30.0) == 30.0
    assert calibrate(points, 4.0) == 17.0
    # figures closer than SLOPE_SPREAD_GB tell no slope from noise: the model's own, from the nearest
    assert calibrate([(10.0, 20.0), (10.5, 20.1)], 20.5) == 30.1
    # least squares over several; a slope out of SLOPES is held to its bounds
    assert abs(calibrate([(0.0, 0.0), (10.0, 6.0), (20.0, 10.0)], 30.0) - 15.0) < 1e-9
    assert calibrate([(0.0, 5.0), (10.0, 5.0)], 20.0) == 5.0 + 10 * SLOPES[0]
    assert calibrate([(0.0, 0.0), (10.0, 50.0)], 20.0) == 50.0 + 10 * SLOPES[1]


def test_the_recorded_tune_predicts_the_budgets_that_fit_from_its_own_trials() -> None:
    """The five trials of `zbench tune` on GRPO ZeRO-2 within 28 GB (results/reference/h200x2-dense-20261128,
    gpu-tune-grpo-z2): the memory model's phases for each geometry (`zbench.harness.tune.case_space` at the reference
    config) and what each trial measured at the end of the rollout and of training. Budgets 0.2 and 0.25 at
    micro-batch 32 then ran as cases on 2 x H200: 26.76 and 28.40 GB. Calibrated on the two trials that differ from
    them in the budget alone, the prediction lands within 0.25 GB of both, on the right side of 28; fitted across
    the micro-batch and checkpointing trials too, it put 0.2 at 28.7 GB."""
    model = {Geometry(32, 0, False, activation_budget=0.05): 18.437, Geometry(16, 0, False, activation_budget=0.05): 15.145,
             Geometry(64, 0, True, activation_budget=0.05): 18.603, Geometry(64, 0, False, activation_budget=0.0): 18.603,
             Geometry(32, 0, False, activation_budget=0.1): 21.645, Geometry(32, 0, False, activation_budget=0.2): 27.041,
             Geometry(32, 0, False, activation_budget=0.25): 29.228}
    trials = [(Geometry(32, 0, False, activation_budget=0.05), 24.6669, 22.0927),
              (Geometry(16, 0, False, activation_budget=0.05), 24.6962, 18.079),
              (Geometry(64, 0, True, activation_budget=0.05), 24.6962, 20.5848),
              (Geometry(64, 0, False, activation_budget=0.0), 24.6962, 20.2294),
              (Geometry(32, 0, False, activation_budget=0.1), 24.6962, 23.8973)]
    search = Search(Space(train_micros=(16, 32, 64), forward_micros=(), checkpointing=(False, True),
                          start=trials[0][0], budget_gb=28.0, budgets=(0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3),
                          predict_gb=lambda g: max(21.216, model[g]),
                          predict_phases=lambda g: Phases(gen=21.216, train=model[g])))
    search.trials = [TrialResult(g, OK, 3.0, max(gen, train), 0.0, 1.0, Phases(gen, train)) for g, gen, train in trials]
    at_02, at_025 = (search.predicted_gb(Geometry(32, 0, False, activation_budget=b)) for b in (0.2, 0.25))
    assert abs(at_02 - 26.76) < 0.25 and at_02 <= 28.0
    assert abs(at_025 - 28.40) < 0.25 and at_025 > 28.0
    assert len(search.calibrating(Geometry(32, 0, False, activation_budget=0.2))) == 2
    # no trial differs from it in one knob alone: those that checkpoint as it does
    assert len(search.calibrating(Geometry(128, 0, False, activation_budget=0.3))) == 4
    # micro-batch 64 at the case's budget, which the tune of results/reference/h200x2-tune-20261128 then ran: 30.18
    # GB. One trial differs from it in the budget alone (micro 64 at 0), which only shifts the model; the two at
    # micro 32 and 16 differ in the micro-batch alone and show its slope, so they calibrate it: over the budget,
    # within 0.25 GB of what it measured. Fitted across the first three (the third checkpointed), as the tune did,
    # training came to 26.67 GB, under the budget, and the trial ran over.
    micro_64 = Geometry(64, 0, False, activation_budget=0.05)
    model[micro_64] = 25.02
    assert [t.geometry.train_micro for t in search.calibrating(micro_64)] == [32, 16]
    assert abs(search.predicted_gb(micro_64) - 30.18) < 0.25 and not search.fits(micro_64)
    across = calibrate([(model[g], train) for g, _, train in trials[:3]], model[micro_64])
    assert abs(across - 26.67) < 0.01


def test_near_ties_go_to_material_memory_savings_not_to_hundredths_of_a_gb() -> None:
    """The calibrated tune of GRPO ZeRO-2 within 28 GB on 2 x H200 (results/reference/h200x2-tune-20261128): six
    trials, their updates' and passes' seconds and peaks as recorded. Budget 0.2 was fastest (0.998 s); 0.05
    (1.027 s) and 0.1 (1.009 s) lie within the tolerance of it. Choosing the least memory among them took 0.05 for
    0.03 GB less than 0.1. Of those less than MEMORY_TIE of the 28 GB budget (0.56 GB) above the least, the faster
    wins: 0.1; 0.2, 2.3 GB above, stays out."""
    recorded = [((32, 0.05), 1.0273, 24.6669), ((16, 0.05), 1.30685, 24.6962), ((64, 0.05), 1.28813, 24.6962),
                ((64, 0.05), 1.02484, 30.1825), ((32, 0.1), 1.0094, 24.6962), ((32, 0.2), 0.998195, 26.9833)]
    search = Search(space(budget=28.0))
    for i, ((micro, budget), geometry_s, peak) in enumerate(recorded):
        g = Geometry(micro, 0, i == 2, activation_budget=budget)
        status = OK if peak <= 28.0 else OVER_BUDGET
        search.trials.append(TrialResult(g, status, geometry_s + 1.8, peak, 0.0, geometry_s))
    assert search.best().geometry == Geometry(32, 0, False, activation_budget=0.1)
    # a saving past MEMORY_TIE of the budget is worth the speed the timed steps cannot tell apart
    search.trials[0] = replace(search.trials[0], peak_gb=24.6962 - MEMORY_TIE * 28.0 - 0.01)
    assert search.best().geometry == Geometry(32, 0, False, activation_budget=0.05)


def test_a_larger_micro_batch_that_is_no_faster_still_lets_smaller_ones_be_tried() -> None:
    """Micro-batch 8 is within the timing tolerance of 4 and needs about as much memory, so it would be chosen
    over 4; growing still did not pay, and the smaller micro-batches are tried: 2 is the fastest."""
    steps, peaks = {4: 1.0, 8: 0.99, 2: 0.85, 1: 1.2}, {4: 10.0, 8: 10.3, 2: 9.0, 1: 8.5}
    search = drive(space(start=4, checkpointing=(False,)), lambda g: TrialResult(g, OK, steps[g.train_micro],
                                                                                  peaks[g.train_micro]))
    assert tried(search) == [(4, 0, False), (8, 0, False), (2, 0, False), (1, 0, False)]
    assert search.best().geometry.train_micro == 2


def test_phases_calibrate_apart_so_a_budget_that_fits_is_found() -> None:
    """GRPO at the reference config on 2 x H200 (results/reference/h200x2-dense-20261128), micro-batch 32: the
    rollout's KV cache sets the peak at the case's budget (0.05), and the memory model counts every sequence at full
    length, so it grows the training phase about 1.75 times as fast as it grew there. Calibrated whole, the first
    trials' peaks are the rollout's, which say nothing of training: the search walks up a step at a time and its
    last attempt runs over budget short of 0.2. Phase by phase, the second trial shows training's slope and the
    third lands on 0.2, the largest budget within 28 GB."""
    budgets = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)

    def model(g: Geometry) -> Phases:  # the memory model's figures for this case (GB)
        return Phases(gen=21.22, train=7.22 + 8.0 + 64.0 * (g.activation_budget or 0.0))

    def world(g: Geometry) -> TrialResult:  # what the GPU measured: 21.84 GB trained at 0.05, 26.76 at 0.2
        m = model(g)
        phases = Phases(gen=24.41, train=21.84 + (m.train - model(start).train) / 1.75)
        peak = max(phases.gen, phases.train)
        step = 1.0 - 0.3 * (g.activation_budget or 0.0)
        return TrialResult(g, OK if peak <= 28.0 else OVER_BUDGET, step, peak, 0.0, step, phases)

    start = Geometry(32, 0, False, activation_budget=0.05)
    common = dict(train_micros=(32,), forward_micros=(), checkpointing=(False,), start=start, budget_gb=28.0,
                  budgets=budgets, predict_gb=lambda g: max(model(g).gen, model(g).train))
    whole = drive(Space(**common), world)
    assert [(t.geometry.activation_budget, t.status) for t in whole.trials] == [
        (0.05, OK), (0.1, OK), (0.15, OK), (0.25, OVER_BUDGET)]
    phased = drive(Space(**common, predict_phases=model), world)
    assert [(t.geometry.activation_budget, t.status) for t in phased.trials] == [(0.05, OK), (0.1, OK), (0.2, OK)]
    assert phased.best().geometry.activation_budget == 0.2
    assert "activation budget: no budget above 0.2 is predicted to fit micro 32 within 28.00 GB" in phased.notes


def test_an_over_budget_start_shrinks_until_one_fits() -> None:
    def world(g: Geometry) -> TrialResult:
        peak = 2.0 * g.train_micro
        return TrialResult(g, OVER_BUDGET if peak > 5 else OK, 1.0 / g.train_micro, peak)

    search = drive(space(budget=5, start=8, predict=lambda g: 2.0 * g.train_micro, checkpointing=(False,)), world)
    # 8 is predicted over budget (16 GB) so the start is the largest predicted to fit: 2
    assert tried(search)[0] == (2, 0, False)
    assert search.best().geometry.train_micro == 2


def test_no_smaller_micro_batch_is_tried_when_the_model_says_none_can_save_enough() -> None:
    # measured 50 GB against a budget of 10; the model says shrinking saves a few hundredths of a GB
    search = drive(space(budget=10, start=4, predict=lambda g: 0.01 * g.train_micro, checkpointing=(False,)),
                   lambda g: TrialResult(g, OVER_BUDGET, 1.0, 50.0))
    assert tried(search) == [(4, 0, False)]
    assert any("no smaller micro-batch tried" in n for n in search.notes)
    assert search.best() is None


def test_an_oom_without_a_memory_figure_shrinks_one_step_at_a_time() -> None:
    def world(g: Geometry) -> TrialResult:
        return TrialResult(g, "oom") if g.train_micro > 1 else TrialResult(g, OK, 2.0, 3.0)

    search = drive(space(start=4, checkpointing=(False,)), world)
    assert tried(search) == [(4, 0, False), (2, 0, False), (1, 0, False)]
    assert search.best().geometry.train_micro == 1


def test_a_start_that_fails_for_another_reason_ends_the_search() -> None:
    search = drive(space(start=4), lambda g: TrialResult(g, "failed"))
    assert tried(search) == [(4, 0, False)]
    assert any("for another reason than memory" in n for n in search.notes)


def test_nothing_predicted_to_fit_is_measured_once_at_the_most_frugal_geometry() -> None:
    search = drive(space(budget=1, predict=lambda g: 100.0), lambda g: TrialResult(g, OVER_BUDGET, 1.0, 100.0))
    assert tried(search) == [(1, 0, True)]
    assert "no geometry is predicted to fit" in search.notes[0]


def test_forward_micro_batch_grows_when_the_gradient_free_passes_are_worth_it() -> None:
    steps = {(2, 0): 1.0, (4, 0): 1.2, (1, 0): 1.1, (2, 4): 0.8, (2, 8): 0.79}

    def world(g: Geometry) -> TrialResult:
        return TrialResult(g, OK, steps[(g.train_micro, g.forward_micro)], 1.0 + 0.2 * g.forward_micro, 0.4)

    search = drive(space(budget=20.0, start=2, micros=(1, 2, 4), forwards=(1, 2, 4, 8)), world)
    # 8 is not 3 % faster than 4: the growth stops there, and of two steps the noise cannot tell apart the one that
    # needs materially less memory (0.8 GB, more than MEMORY_TIE of the 20 GB budget) is chosen
    assert tried(search) == [(2, 0, False), (4, 0, False), (1, 0, False), (2, 4, False), (2, 8, False)]
    assert search.best().geometry == Geometry(2, 4, False)


def test_forward_micro_batch_is_pruned_when_its_passes_take_too_little_of_the_step() -> None:
    search = drive(space(start=2, micros=(1, 2), forwards=(1, 2, 4, 8)), timed({2: 1.0, 1: 1.5}, forward_s=0.01))
    assert all(t.geometry.forward_micro == 0 for t in search.trials)
    assert any("gradient-free passes take 0.010 s" in n for n in search.notes)


def test_fixed_knobs_are_never_varied() -> None:
    search = drive(space(start=4, micros=(4,), checkpointing=(True,)), timed({4: 1.0}))
    assert tried(search) == [(4, 0, True)]


def test_the_number_of_trials_is_capped() -> None:
    search = drive(space(start=1, micros=tuple(range(1, 30)), max_trials=3),
                   lambda g: TrialResult(g, OK, 1.0 / g.train_micro, 1.0))
    assert len(search.trials) == 3
    assert any("stopped at 3 trials" in n for n in search.notes)


def test_the_time_budget_stops_before_a_trial_that_would_not_finish() -> None:
    assert out_of_time(None, None, [100.0]) is None
    assert out_of_time(600, 500, []) is None  # the first trial: nothing to go by
    assert out_of_time(600, 500, [80.0, 120.0]) is None
    assert "100 s left, the longest trial so far took 120 s" in (out_of_time(600, 100, [80.0, 120.0]) or "")
    assert out_of_time(600, -3, []) is not None
    # within a case's share of the budget: the message says whose time ran out
    assert (out_of_time(600, 50, [80.0], share=300) or "").startswith("time budget of 600 s (this case's share: 300 s)")


def test_divisors() -> None:
    assert divisors(12) == (1, 2, 3, 4, 6, 12)


def test_the_memory_model_of_a_geometry() -> None:
    from zbench.analyze.activations import geometry_memory
    from zbench.analyze.memory import estimate_case
    from zbench.config import RunConfig, from_dict
    from zbench.engine.vllm_rollout import fitted_kv_cache_bytes

    def cfg(**sections: dict) -> RunConfig:  # the plain head: its logits grow with the micro-batch
        return from_dict({"model": {"path": "qwen3-0.6b", "fused_head": False},
                          "trainer": {"world_size": 2, "train_batch_size": 8},
                          "algorithm": "grpo", "rollout": {"n": 4, "max_new_tokens": 256},
                          "actor": {"ppo_mini_batch_size": 8, **sections.get("actor", {})},
                          **{k: v for k, v in sections.items() if k != "actor"}})

    plain = geometry_memory(cfg(actor={"micro_batch_size_per_gpu": 4}), on_cuda=True)
    double = geometry_memory(cfg(actor={"micro_batch_size_per_gpu": 8}), on_cuda=True)
    ckpt = geometry_memory(cfg(actor={"micro_batch_size_per_gpu": 8}, model={"path": "qwen3-0.6b", "fused_head": False,
                                                                           "gradient_checkpointing": True}),
                           on_cuda=True)
    assert plain.states == estimate_case(cfg(), on_cuda=True).gpu_bytes  # the ZeRO model's figure, unchanged
    assert double.training == 2 * plain.training  # linear in the micro-batch
    assert ckpt.training < double.training and ckpt.states == double.states
    wide = geometry_memory(cfg(actor={"micro_batch_size_per_gpu": 4, "forward_micro_batch_size_per_gpu": 16}),
                           on_cuda=True)
    assert wide.forward == 4 * plain.forward and wide.peak_bytes > plain.peak_bytes
    fitted = geometry_memory(cfg(rollout={"n": 4, "max_new_tokens": 256, "backend": "vllm", "kv_cache_fit": True}),
                             on_cuda=True)
    shape = type("Shape", (), {"num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                               "head_dim": 128, "hidden_size": 1024})
    assert fitted.kv_cache == fitted_kv_cache_bytes(shape, 16, 256 + 256, 1)  # 8 prompts x 4 samples / 2 ranks
    share = geometry_memory(cfg(rollout={"n": 4, "backend": "vllm"}), on_cuda=True, device_bytes=100 * 2**30)
    assert share.kv_cache == int(0.35 * 100 * 2**30)
    assert geometry_memory(cfg(), on_cuda=False).kv_cache == 0  # no vLLM on CPU
    # the fused head holds one chunk of logits, whatever the micro-batch: (256 + 256) x 8 tokens fit in one chunk
    fused = [geometry_memory(cfg(actor={"micro_batch_size_per_gpu": b}, model={"path": "qwen3-0.6b"}), on_cuda=True)
             for b in (8, 16)]
    head = 4096 * 151936 * 8
    assert fused[0].training == double.training - 8 * 512 * 151936 * 8 + head
    assert fused[1].training - fused[0].training == (double.training - plain.training - 4 * 512 * 151936 * 8) * 2


def test_a_cases_own_knobs_and_set_values_are_fixed() -> None:
    from zbench.harness.matrix import expand, load_matrix
    from zbench.harness.tune import case_space

    six = expand(load_matrix("six-case"), case_globs=["zero2_no_offload"])
    free = case_space(six[0], budget_gb=10.0, on_cuda=False, device_bytes=0)
    assert free.keys == {"train": ("actor.micro_batch_size_per_gpu", "critic.micro_batch_size_per_gpu"),
                         "forward": ("actor.forward_micro_batch_size_per_gpu", "critic.forward_micro_batch_size_per_gpu"),
                         "checkpointing": ("model.gradient_checkpointing",),
                         "checkpoint_layers": ("model.checkpoint_layers",),
                         "activation_budget": ()}  # the CPU's layers are not compiled: no budget to tune
    assert free.search.space.budgets == () and free.search.space.start.activation_budget is None
    # 8 prompts x 1 sample over 2 ranks: micro-batches of 1, 2 or 4 divide a rank's mini-batch of 4 sequences
    assert free.search.space.train_micros == (1, 2, 4) and free.search.space.checkpointing == (False, True)
    assert free.overrides(Geometry(2, 4, True)) == {
        "actor.micro_batch_size_per_gpu": 2, "critic.micro_batch_size_per_gpu": 2,
        "actor.forward_micro_batch_size_per_gpu": 4, "critic.forward_micro_batch_size_per_gpu": 4,
        "model.gradient_checkpointing": True, "model.checkpoint_layers": None}
    assert free.search.space.num_layers == 2  # the tiny model's decoder layers: checkpointing fewer may be tried
    assert free.overrides(Geometry(2, 4, True, 1))["model.checkpoint_layers"] == 1
    assert free.overrides(Geometry(2, 4, False, 1))["model.checkpoint_layers"] is None  # nothing to checkpoint

    ac = expand(load_matrix("ddp-vs-zero"), case_globs=["zero2_ac"], sets=[("actor.micro_batch_size_per_gpu", 2)])
    fixed = case_space(ac[0], budget_gb=10.0, on_cuda=False, device_bytes=0)
    assert fixed.keys["train"] == ("critic.micro_batch_size_per_gpu",)  # the actor's is the user's
    assert fixed.keys["checkpointing"] == () and fixed.search.space.checkpointing == (True,)  # the case's own axis
    assert "actor.micro_batch_size_per_gpu" not in fixed.overrides(Geometry(1, 0, True))


def test_trials_are_compared_on_the_phases_geometry_changes_not_the_whole_step() -> None:
    # generation's spread makes micro 4's step look slower; its update is faster, and that is what the geometry moved
    steps = {1: (4.6, 1.5), 2: (4.0, 1.2), 4: (4.3, 0.9), 8: (4.1, 1.0), 16: (4.5, 1.1)}
    search = drive(space(start=2), lambda g: TrialResult(g, OK, steps[g.train_micro][0], 1.0, 0.0,
                                                        steps[g.train_micro][1]))
    assert tried(search)[:3] == [(2, 0, False), (4, 0, False), (8, 0, False)]
    assert search.best().geometry.train_micro == 4
    # one measure for a whole case: where some trial measured no phase, every trial is compared on its step
    mixed = drive(space(start=2), lambda g: TrialResult(g, OK, steps[g.train_micro][0], 1.0, 0.0,
                                                       None if g.train_micro == 8 else steps[g.train_micro][1]))
    assert mixed.best().geometry.train_micro == 2 and mixed.ranked_s(mixed.trials[1]) == 4.3


def _tune_with_stand_in_trials(tmp_path, monkeypatch, **request):
    """`run_tune` of three six-case cases whose trials are stood in for: a case's first trial (a session start)
    takes 40 s of the tune's own clock, a later one 10 s; every trial peaks at 1 GB. Returns the outcome, the case
    of each trial in order, and what the tune printed."""
    import io

    from zbench.config import parse_set
    from zbench.harness import tune as tune_mod

    now = [0.0]
    calls: list[str] = []

    def trial(self, tune, g, left_s):
        first = tune.case.name not in calls
        took = 40.0 if first else 10.0
        now[0] += took
        (self.walls_started if first else self.walls_served).append(took)
        calls.append(tune.case.name)
        name = f"{tune.case.name}.t{len(tune.search.trials) + 1}"
        tune.trial_names[g] = name
        self.rows.append({"case": tune.case.name, "trial": name, "status": OK, "step_s": 1.0})
        return TrialResult(g, OK, 1.0 + 1.0 / g.train_micro, 1.0, 0.0, None), None

    monkeypatch.setattr(tune_mod._Tuner, "trial", trial)
    req = tune_mod.TuneRequest(matrix="six-case", case_globs=CASES3, results_dir=str(tmp_path),
                               sets=(parse_set("steps=2"),), **request)
    out = io.StringIO()
    outcome = tune_mod.run_tune(req, ["zbench", "tune"], out=out, clock=lambda: now[0])
    return outcome, calls, out.getvalue()


CASES3 = ("zero1_no_offload", "zero2_no_offload", "zero3_no_offload")


def test_the_time_budget_is_shared_so_every_case_gets_its_turn(tmp_path, monkeypatch) -> None:
    """150 s for three cases: each may go on within its share of what is left at its turn (50, then 55, then 70 s);
    the first case's running out of its share does not end the tune."""
    outcome, calls, printed = _tune_with_stand_in_trials(tmp_path, monkeypatch, time_budget_s=150)
    assert calls == list(CASES3)  # one trial each: every case had its turn
    assert "zero2_no_offload: 55 s of the time budget (an equal share of the 110 s left)" in printed
    assert outcome.stopped is not None and outcome.stopped.startswith("time budget of 150 s (this case's share: 50 s)")
    assert all(t.chosen() is not None for t in outcome.cases)


def test_a_chosen_peak_close_to_the_memory_budget_is_pointed_out(tmp_path, monkeypatch) -> None:
    outcome, _, printed = _tune_with_stand_in_trials(tmp_path, monkeypatch, memory_budget_gb=1.05)
    assert outcome.stopped is None and all(t.complete for t in outcome.cases)
    assert printed.count("the chosen geometry's peak, 1.00 GB, is 95% of the memory budget") == 3
    _, _, roomy = _tune_with_stand_in_trials(tmp_path / "roomy", monkeypatch, memory_budget_gb=2.0)
    assert "of the memory budget" not in roomy
