"""Issue 17's generated composition-matrix test: every declared pair trains like one process, or is refused.

The pairs and their status come from the installed plugins' declarations (``composition_matrix().pairs()``), never
from a table kept here. For each pair:

* **refused** (``Refusal``): ``initialize()`` of the pair's model and config, on the pair's topology, raises
  ``microspeed.ConfigError`` whose message contains ``refusal.message()``;
* **supported**: the pair trains ``plan.steps`` global batches on up to 4 gloo ranks, and its per-step losses equal
  the single-process run of the same model and global batch (parallelism dropped, algorithmic features kept):
  relative 1e-5 in fp32, the recipe's stated tolerance otherwise (fp16/bf16; compressed optimizers: warm-up exact,
  later steps in a band).

Each feature's recipe (tests/matrix/matrix_recipes.py) says how to turn it on; pairs are combined generically, so a
pair moves from refused to supported when its plugin deletes the refusal and the code that raised it. All selected
pairs run in one spawned job per world size (module fixture ``matrix_results``); each pair is its own test id.
A quick subset (one pair per feature, cheapest first) runs by default; the rest are ``slow``.

``MATRIX_REPORT=<path>`` writes the results table (status, topology, losses, timings) to a file.
"""

from __future__ import annotations

import os
import time

import pytest
from matrix_model import N_MICRO, ModelSpec
from matrix_recipes import MAX_WORLD, RECIPES, Plan, compare_losses, merged_config, plan_pair
from matrix_runner import MatrixResult, run_matrix

from microspeed.plugin_api import composition_matrix

KNOWN_MISMATCHES: dict[str, str] = {}
"""Pairs declared supported that do not match their reference today: ``"a+b"`` -> what differs. They run as
``xfail(strict=True)``, so they stay visible and the entry must go when the pair is fixed."""


def _declared():
    try:
        return composition_matrix(), ""
    except Exception as exc:  # the declarations themselves are broken: one test says so, no pair runs
        return None, f"{type(exc).__name__}: {exc}"


MATRIX, MATRIX_ERROR = _declared()
PAIRS: list[tuple[str, str]] = [] if MATRIX is None else [
    (fa.name, fb.name) for fa, fb, _ in MATRIX.pairs() if fa.name in RECIPES and fb.name in RECIPES]


def _fast_pairs(pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """One pair per feature for the quick subset: greedily, cheapest tier first (fewest ranks, runnable, supported),
    pairs of two uncovered features before pairs of one."""
    plans = {p: plan_pair(*p) for p in pairs}

    def cost(p: tuple[str, str]) -> tuple:
        plan = plans[p]
        refused = MATRIX is not None and MATRIX.status(*p) is not None
        known = f"{p[0]}+{p[1]}" in KNOWN_MISMATCHES
        return (plan.world > MAX_WORLD, plan.unexpressible is not None, known, plan.world, refused, plan.steps)

    covered: set[str] = set()
    chosen: set[tuple[str, str]] = set()
    for tier in sorted({cost(p)[:4] for p in pairs}):
        for need in (2, 1):
            for p in sorted((q for q in pairs if cost(q)[:4] == tier), key=cost):
                if len({*p} - covered) >= need:
                    chosen.add(p)
                    covered |= {*p}
    return chosen


FAST = _fast_pairs(PAIRS)


def _params() -> list:
    out = []
    for a, b in PAIRS:
        key = f"{a}+{b}"
        marks = [] if (a, b) in FAST else [pytest.mark.slow]
        if key in KNOWN_MISMATCHES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_MISMATCHES[key]))
        out.append(pytest.param(a, b, id=key, marks=marks))
    return out


def _selected_pairs(session: pytest.Session) -> list[tuple[str, str]]:
    """The pairs of this module's ``test_pair`` items that this session runs (so ``-m 'not slow'`` runs few)."""
    pairs = []
    for item in session.items:
        if getattr(item, "originalname", None) == "test_pair" and item.module.__name__ == __name__:
            pairs.append((item.callspec.params["a"], item.callspec.params["b"]))
    return pairs


@pytest.fixture(scope="module")
def matrix_results(request: pytest.FixtureRequest) -> dict[str, MatrixResult]:
    """Every selected pair's run and reference, from one job per world size and one job of references."""
    plans = [plan_pair(a, b) for a, b in _selected_pairs(request.session)]
    started = time.perf_counter()
    results, timings = run_matrix(plans, MAX_WORLD)
    timings["total"] = time.perf_counter() - started
    report = os.environ.get("MATRIX_REPORT")
    if report:
        with open(report, "w") as f:
            f.write(_table(plans, results, timings))
    return results


def _table(plans: list[Plan], results: dict[str, MatrixResult], timings: dict[str, float]) -> str:
    lines = ["| pair | declared | topology | outcome | losses (run / reference) | s |", "|---|---|---|---|---|---|"]
    for plan in plans:
        refusal = MATRIX.status(*plan.features) if MATRIX is not None else None
        declared = "refused" if refusal else "supported"
        r = results.get(plan.key)
        if r is None:
            lines.append(f"| {plan.key} | {declared} | {plan.describe()} | not run: "
                         f"{plan.unexpressible or 'more ranks'} | | |")
            continue
        verdict = _verdict(plan, r, refusal)
        losses = ""
        if r.run.status == "ok" and r.reference is not None:
            losses = f"{[round(x, 6) for x in r.run.losses]} / {[round(x, 6) for x in r.reference.losses]}"
        lines.append(f"| {plan.key} | {declared} | {plan.describe()} | {verdict or 'as declared'} | {losses} | "
                     f"{r.run.seconds:.1f} |")
    lines += ["", *(f"- {name}: {seconds:.1f} s" for name, seconds in timings.items())]
    return "\n".join(lines) + "\n"


def _verdict(plan: Plan, r: MatrixResult, refusal) -> str | None:
    """None when the pair behaves as declared, else what is wrong."""
    run = r.run
    if refusal is not None:
        expected = refusal.message()
        if run.status == "config_error" and expected in run.message:
            return None
        if run.status == "ok":
            return f"declared refused ({expected!r}) but initialize() accepted it and it trained: {run.losses}"
        return (f"declared refused with {expected!r}, but the run ended in {run.status}: {run.error_type}: "
                f"{run.message}\n{run.trace}")
    if run.status != "ok":
        what = "initialize() refused it" if run.status == "config_error" else f"the run failed ({run.status})"
        return f"declared supported, but {what}: {run.error_type}: {run.message}\n{run.trace}"
    ref = r.reference
    if ref is None or ref.status != "ok":
        return f"the single-process reference failed: {ref and ref.error_type}: {ref and ref.message}"
    for rank, losses in enumerate(run.rank_losses or [run.losses]):
        diff = compare_losses(plan, losses, ref.losses)
        if diff:
            return f"rank {rank} ({plan.describe()}): {diff}" + (f" [{plan.tolerance_why}]" if plan.tolerance_why
                                                                    else "")
    return None


def test_the_declarations_load_and_every_declared_feature_has_a_recipe():
    assert MATRIX is not None, f"composition_matrix() failed: {MATRIX_ERROR}"
    missing = [f.name for f in MATRIX.features if f.name not in RECIPES]
    assert not missing, (f"features declared without a recipe in tests/matrix/matrix_recipes.py: {missing}; add one "
                         f"(what the feature needs, its config fragment, what the reference keeps, its tolerance)")


def test_every_recipe_combines_with_itself_into_a_plan_of_at_most_four_ranks():
    for name, recipe in RECIPES.items():
        plan = plan_pair(name, name)
        assert plan.unexpressible is None and plan.world <= MAX_WORLD, (name, plan)
        assert plan.dp * plan.pp * plan.tp == plan.world and 4 % plan.dp == 0, (name, plan.describe())
        if not recipe.algorithmic:  # parallelism: the reference is the plain model without it, in one process
            assert plan.ref_config == merged_config([], N_MICRO) and plan.ref_model == ModelSpec(), name
        else:  # an algorithmic feature stays on in the reference
            assert plan.ref_config == merged_config([recipe], N_MICRO), name


MATRIX_TIMEOUT = 1500
"""Seconds the first pair's item may take: it runs the whole matrix (the module fixture) before its own check."""


@pytest.mark.timeout(MATRIX_TIMEOUT)
@pytest.mark.parametrize(("a", "b"), _params())
def test_pair(a: str, b: str, matrix_results: dict[str, MatrixResult]) -> None:
    assert MATRIX is not None, MATRIX_ERROR
    refusal = MATRIX.status(a, b)
    plan = plan_pair(a, b)
    if plan.unexpressible is not None:
        # both features set one key: one config cannot hold the pair, which only a refusal may say
        assert refusal is not None, f"declared supported, but one config cannot hold both: {plan.unexpressible}"
        return
    if plan.world > MAX_WORLD:
        pytest.skip(f"{plan.describe()}: more ranks than this machine runs ({MAX_WORLD})")
    verdict = _verdict(plan, matrix_results[plan.key], refusal)
    assert verdict is None, f"{a} x {b}: {verdict}"


def test_the_checks_can_fail():
    """A changed loss, a wrong refusal text, an unexpected acceptance: each is reported, not passed."""
    from matrix_runner import Outcome

    plan = plan_pair("zero-1", "activation-checkpointing")
    ref = Outcome("ok", losses=[3.0, 2.5, 2.0, 1.5])
    good = Outcome("ok", losses=[3.0, 2.5, 2.0], rank_losses=[[3.0, 2.5, 2.0]] * 2)
    assert _verdict(plan, MatrixResult(plan, good, ref), None) is None
    off = Outcome("ok", losses=[3.0, 2.5, 2.0], rank_losses=[[3.0, 2.5, 2.0], [3.0, 2.5, 2.0001]])
    assert "rank 1" in _verdict(plan, MatrixResult(plan, off, ref), None)
    refused = Outcome("config_error", message="zero_optimization.stage: something else; use X")

    class Declared:
        def message(self) -> str:
            return "the declared reason; use Y"

    assert "declared refused" in _verdict(plan, MatrixResult(plan, refused), Declared())
    assert "declared refused" in _verdict(plan, MatrixResult(plan, good, ref), Declared())
    assert _verdict(plan, MatrixResult(plan, Outcome("config_error", message="k: the declared reason; use Y")),
                    Declared()) is None
    assert "refused it" in _verdict(plan, MatrixResult(plan, refused), None)
    compressed = plan_pair("onebit-adam", "zero-1")  # warm-up exact, the last step within the band
    ref4 = [3.0, 2.5, 2.0, 1.5]
    assert compare_losses(compressed, [3.0, 2.5, 2.0, 1.5 * (1 + compressed.band / 2)], ref4) is None
    assert "step 2" in compare_losses(compressed, [3.0, 2.5, 2.001, 1.5], ref4)
    assert "step 3" in compare_losses(compressed, [3.0, 2.5, 2.0, 1.5 * (1 + 2 * compressed.band)], ref4)
