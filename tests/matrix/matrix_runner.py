"""Runs the composition matrix: many pairs per spawned job (one job per world size), references in one process.

:func:`run_plan` builds one pair's model and engine in a rank, trains ``plan.steps`` global batches and returns
the per-step losses (or the ``ConfigError`` initialize() raised). :func:`job` loops over a list of plans in every
rank of one :func:`microspeed.testing.run_distributed` job and writes each plan's result to a file as soon as it is
done, so a pair that fails a rank (or hangs until the watchdog stops the job) costs only that pair:
:func:`run_plans` starts the job again with the pairs that had not run. References (the single-process runs) go
through the same functions in one 1-rank job, one run per distinct reference.
"""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Any

import matrix_model
from matrix_model import N_MICRO, ModelSpec, build_pipeline, build_stack, micro_batch
from matrix_recipes import NVME_PLACEHOLDER, RECIPES, Plan

JOB_TIMEOUT = 900.0
"""Seconds one job may take (a hang ends earlier: the ranks' watchdog stops it after WATCHDOG_S)."""

WATCHDOG_S = 20
"""Seconds a rank may wait in one collective before microspeed's watchdog stops the job."""


@dataclass
class Outcome:
    """What one run (a pair on its ranks, or a reference in one process) gave.

    Attributes:
        status: ``"ok"`` (losses), ``"config_error"`` (initialize() or the model raised ConfigError), ``"error"``
            (anything else raised), ``"lost"`` (the job died on this run: ``message`` says how).
        losses: per-step losses of rank 0; ``rank_losses`` all ranks'.
        message / error_type / trace: the error.
        seconds: wall time of the run in rank 0.
    """

    status: str
    losses: list[float] = field(default_factory=list)
    rank_losses: list[list[float]] = field(default_factory=list)
    message: str = ""
    error_type: str = ""
    trace: str = ""
    seconds: float = 0.0


def _fill_paths(value: Any, folder: str) -> Any:
    if isinstance(value, dict):
        return {k: _fill_paths(v, folder) for k, v in value.items()}
    return folder if value == NVME_PLACEHOLDER else value


def _train(plan: Plan, folder: str) -> list[float]:
    import torch
    import torch.distributed as dist
    from microspeed_pipeline import PipeModelDataParallelTopology, initialize_model_parallel, set_default_grid

    import microspeed

    world = dist.get_world_size() if dist.is_initialized() else 1
    spec: ModelSpec = plan.model
    mpu = None
    pipelined = plan.pp > 1 or plan.ref_pipelined  # a reference with ref_pipelined: a one-stage pipeline
    try:
        if pipelined:
            topo = PipeModelDataParallelTopology(num_pp=plan.pp, num_mp=plan.tp, num_dp=world // (plan.pp * plan.tp))
            model = build_pipeline(spec, topo, plan.chunks)
        else:
            if plan.tp > 1:
                mpu = initialize_model_parallel(tensor_model_parallel_size=plan.tp)
            model = build_stack(spec)
        config = _fill_paths(plan.config, folder)
        engine, *_ = microspeed.initialize(model=model, config=config, mpu=mpu)
        dp, d = engine.topology.data_parallel_size, engine.topology.data_parallel_rank
        gas = N_MICRO // dp
        losses = []
        for step in range(plan.steps):
            matrix_model.STEP = step
            mine = [micro_batch(step, i) for i in range(d * gas, (d + 1) * gas)]
            loss = engine.train_batch(iter(mine))
            if not pipelined and dp > 1:  # the plain loop returns this rank's mean; the pipeline's is global
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=engine.topology.data_parallel_group)
                loss /= dp
            losses.append(float(loss))
        if not all(torch.isfinite(torch.tensor(losses))):
            raise FloatingPointError(f"non-finite losses {losses}")
        return losses
    finally:
        set_default_grid(None)


def run_plan(plan: Plan, folder: str) -> Outcome:
    """Run ``plan`` in this rank (inside a job, or in one process for a reference); never raises."""
    import microspeed

    started = time.perf_counter()
    try:
        losses = _train(plan, folder)
        outcome = Outcome("ok", losses=losses)
    except microspeed.ConfigError as exc:
        outcome = Outcome("config_error", message=str(exc), error_type=type(exc).__name__)
    except Exception as exc:  # a real failure of a pair: reported with its traceback
        outcome = Outcome("error", message=str(exc), error_type=type(exc).__name__,
                          trace=traceback.format_exc(limit=12))
    outcome.seconds = time.perf_counter() - started
    return outcome


def _result_path(folder: str, index: int, rank: int) -> str:
    return os.path.join(folder, f"plan{index:04d}.rank{rank}.pkl")


def job(plans: list[tuple[int, Plan]], folder: str) -> None:
    """The body of one spawned job: every plan in order, each result written to ``folder`` at once."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    frozen = False
    for index, plan in plans:
        scratch = os.path.join(folder, f"scratch{index:04d}")  # one path in every rank's config (NVMe swap)
        os.makedirs(scratch, exist_ok=True)
        outcome = run_plan(plan, scratch)
        gc.collect()  # the engine's cycles (its threads stop with it); only this pair's objects once frozen
        if not frozen:  # modules and imports of the first pair stay: later collections skip them
            gc.freeze()
            frozen = True
        if dist.is_initialized():
            dist.barrier()
        with open(_result_path(folder, index, rank) + ".tmp", "wb") as f:
            pickle.dump(outcome, f)
        os.replace(_result_path(folder, index, rank) + ".tmp", _result_path(folder, index, rank))


def _collect(plans: list[tuple[int, Plan]], folder: str, world: int) -> dict[int, Outcome]:
    done = {}
    for index, _ in plans:
        paths = [_result_path(folder, index, r) for r in range(world)]
        if not all(os.path.exists(p) for p in paths):
            continue
        per_rank = []
        for p in paths:
            with open(p, "rb") as f:
                per_rank.append(pickle.load(f))
        first = per_rank[0]
        bad = next((o for o in per_rank if o.status != "ok"), None)
        if bad is not None:  # the first rank that did not train tells why
            done[index] = replace(bad, seconds=first.seconds)
        else:
            done[index] = replace(first, rank_losses=[o.losses for o in per_rank])
    return done


def run_plans(plans: list[Plan], world: int) -> list[Outcome]:
    """Run ``plans`` (all of world size ``world``) in as few jobs as possible; one outcome per plan, in order."""
    from microspeed.testing import DistributedTestError, run_distributed

    todo = list(enumerate(plans))
    results: dict[int, Outcome] = {}
    with tempfile.TemporaryDirectory(prefix=f"matrix-w{world}-") as folder:
        idle = 0  # jobs in a row that finished no pair: a job that cannot start fails every pair left
        while todo:
            error = ""
            try:
                run_distributed(job, world_size=world, args=(todo, folder), timeout=JOB_TIMEOUT,
                                env={"MICROSPEED_WATCHDOG_TIMEOUT": str(WATCHDOG_S)})
            except DistributedTestError as exc:
                error = str(exc)
            results.update(_collect(todo, folder, world))
            remaining = [(i, p) for i, p in todo if i not in results]
            if remaining and not error:
                error = "the job ended without a result for this pair"
            idle = idle + 1 if len(remaining) == len(todo) else 0
            if remaining and idle >= 2:
                for i, _ in remaining:
                    results[i] = Outcome("lost", message="the job failed twice before any pair: " + error[-4000:])
                remaining = []
            elif remaining:  # the first pair without a result is the one the job died in
                lost, _ = remaining[0]
                results[lost] = Outcome("lost", message=error[-4000:])
                remaining = remaining[1:]
            todo = remaining
    return [results[i] for i in range(len(plans))]


REFERENCE_STEPS = max(r.steps for r in RECIPES.values())
"""Steps of every reference run (a run of fewer steps is compared with the reference's first ones)."""


def reference_plan(plan: Plan) -> Plan:
    """The single-process run ``plan`` is compared with: one rank, the reference config and model."""
    return replace(plan, world=1, pp=1, chunks=1, tp=1, dp=1, config=plan.ref_config, model=plan.ref_model,
                   steps=REFERENCE_STEPS)


@dataclass
class MatrixResult:
    """A pair's run and its reference (``reference`` None when the run is not compared)."""

    plan: Plan
    run: Outcome
    reference: Outcome | None = None


def run_matrix(plans: list[Plan], max_world: int) -> tuple[dict[str, MatrixResult], dict[str, float]]:
    """Run every expressible plan of at most ``max_world`` ranks and the references of those that trained.

    Returns ``({plan.key: result}, {job name: seconds})``.
    """
    timings: dict[str, float] = {}
    results: dict[str, MatrixResult] = {}
    runnable = [p for p in plans if p.unexpressible is None and p.world <= max_world]
    for world in sorted({p.world for p in runnable}):
        group = [p for p in runnable if p.world == world]
        started = time.perf_counter()
        for plan, outcome in zip(group, run_plans(group, world), strict=True):
            results[plan.key] = MatrixResult(plan, outcome)
        timings[f"world {world} ({len(group)} pairs)"] = time.perf_counter() - started
    refs: dict[str, Plan] = {}
    for r in results.values():
        if r.run.status == "ok":
            refs.setdefault(r.plan.reference_key(), reference_plan(r.plan))
    if refs:
        started = time.perf_counter()
        keys = list(refs)
        outcomes = dict(zip(keys, run_plans([refs[k] for k in keys], 1), strict=True))
        timings[f"references ({len(keys)} single-process runs)"] = time.perf_counter() - started
        for r in results.values():
            if r.run.status == "ok":
                r.reference = outcomes[r.plan.reference_key()]
    return results, timings
