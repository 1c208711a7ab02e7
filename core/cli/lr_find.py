"""``microspeed lr-find``: an LR range test on the user's own training script.

::

    microspeed lr-find [--config ds_config.json] [--min-lr 1e-7] [--max-lr 10] [--steps 100]
                       [--out lr_find.png] [--schedule exp|linear] [--nproc N] script.py [script args]

The script is a DeepSpeed-style training script that calls ``microspeed.initialize(..., config=...)``
(``import microspeed as deepspeed`` works) and trains with ``engine(...)``, ``engine.backward(loss)``,
``engine.step()`` (or ``engine.train_batch()``). It runs unchanged, in this process, except that the first
``initialize()`` call it makes is adjusted:

* its ds_config is ``--config`` when given, else the config the script passes (``config=``,
  ``config_params=`` or ``args.deepspeed_config``);
* that config's ``scheduler`` section is replaced by ``LRRangeTest`` (``lr_range_test_min_lr = --min-lr``,
  ``lr_range_test_step_size = 1``, ``lr_range_test_step_rate`` so that step ``--steps - 1`` reaches
  ``--max-lr``), and a client ``lr_scheduler=`` is dropped;
* a small plugin (:class:`LRFinder`) is registered for that engine. It records, every optimizer step, the lr
  the step used and the mean of the losses ``engine.backward`` received (averaged over the data-parallel
  ranks, so that every rank decides alike), and ends the script (raising :class:`LRFindStop`, a
  ``BaseException`` that an ``except Exception`` in the script does not swallow) after ``--steps`` steps or
  as soon as the loss diverges.

``--schedule exp`` (the default) grows the lr geometrically, ``min * (max/min) ** (i / (steps - 1))`` at
step ``i``, with :class:`ExponentialRangeTest` (an ``LRRangeTest`` whose increase is multiplicative) — the
usual choice for a range spanning decades (1e-7 to 10). ``--schedule linear`` uses DeepSpeed's
``LRRangeTest`` as built from the section, ``min * (1 + rate * i)``, which spends almost every step near the
top of such a range.

**Smoothing and stopping.** Losses are smoothed with a bias-corrected exponential moving average
(``--smoothing``, default 0.8). The run stops early when a loss is not finite or when the smoothed loss
exceeds ``--diverge`` (default 4) times the best smoothed loss so far.

**Suggestion.** The suggested lr is the lr of the steepest descent of the smoothed loss against
``log(lr)`` (differences over ``±max(1, n // 20)`` of the ``n`` steps), searched among the steps up to the
smoothed minimum, the first tenth (at least 2) left out; when the loss never decreases there, it is a tenth
of the lr at the minimum (bounded below by ``--min-lr``). Both the suggestion
and the lr of the smoothed minimum (and a tenth of it, the other common rule) are printed. Rank 0 prints them
and saves the loss-vs-lr plot (log-scaled lr axis) as a PNG (matplotlib, from the ``monitor`` extra).

Under ``torchrun`` (``--nproc N`` launches it, or ``torchrun ... -m microspeed.cli.lr_find ...``) every rank
runs the script and the recorder; only rank 0 plots and prints. Further ``initialize()`` calls of the script
(an evaluation engine) are left as they are.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from microspeed.hookspecs import hookimpl


def __getattr__(name: str) -> Any:
    # the schedule subclasses a torch scheduler: imported on first use, so `microspeed lr-find --help` stays light
    if name == "ExponentialRangeTest":
        from microspeed.cli.lr_find_schedule import ExponentialRangeTest

        return ExponentialRangeTest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


LAUNCH_ENV = "MICROSPEED_LR_FIND_CHILD"
"""Set in the processes ``--nproc`` launches through torchrun, so they run the test instead of launching again."""


class LRFindStop(BaseException):  # noqa: N818 - control flow, like StopIteration
    """Raised from the recorder's step hook to end the user's script: the range test is over."""


@dataclass
class LRFindResult:
    """What an LR range test measured and concluded.

    Attributes:
        lrs: the lr of each recorded optimizer step.
        losses: the mean loss of each step (over micro-batches and data-parallel ranks).
        smoothed: the bias-corrected exponential moving average of ``losses``.
        stop_reason: why the run ended (``"steps"``, ``"diverged: ..."``, ``"script ended"``).
        suggestion: the suggested lr (see the module docstring), or ``None`` without data.
        lr_at_min: the lr of the smallest smoothed loss.
        min_loss: the smallest smoothed loss.
        steepest_index: index of the suggestion's step (``None`` when the fallback rule was used).
    """

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    smoothed: list[float] = field(default_factory=list)
    stop_reason: str = "script ended"
    suggestion: float | None = None
    lr_at_min: float | None = None
    min_loss: float | None = None
    steepest_index: int | None = None


# ------------------------------------------------------------------------------------------------------
# Schedules and the config section.


def range_test_section(min_lr: float, max_lr: float, steps: int) -> dict[str, Any]:
    """The ds_config ``scheduler`` section of an ``LRRangeTest`` going linearly from ``min_lr`` (step 0) to
    ``max_lr`` (step ``steps - 1``)."""
    _check_range(min_lr, max_lr, steps)
    return {
        "type": "LRRangeTest",
        "params": {
            "lr_range_test_min_lr": min_lr,
            "lr_range_test_step_size": 1,
            "lr_range_test_step_rate": (max_lr / min_lr - 1.0) / (steps - 1),
            "lr_range_test_staircase": False,
        },
    }


def _check_range(min_lr: float, max_lr: float, steps: int) -> None:
    if not (isinstance(min_lr, int | float) and math.isfinite(min_lr) and min_lr > 0):
        raise ValueError(f"--min-lr {min_lr!r}: expected a number > 0 (the lr of the first step), e.g. 1e-7.")
    if not (isinstance(max_lr, int | float) and math.isfinite(max_lr)):
        raise ValueError(f"--max-lr {max_lr!r}: expected a finite number larger than --min-lr, e.g. 10.")
    if min_lr >= max_lr:
        raise ValueError(f"--min-lr {min_lr:g} must be smaller than --max-lr {max_lr:g}; swap them or widen the range.")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(f"--steps {steps!r}: expected an integer >= 2 (optimizer steps from --min-lr to --max-lr).")


# ------------------------------------------------------------------------------------------------------
# Analysis.


def smooth(losses: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average of ``losses`` (``beta`` in [0, 1); 0 = no smoothing)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses, start=1):
        avg = beta * avg + (1.0 - beta) * loss
        out.append(avg / (1.0 - beta**i))
    return out


def suggest(lrs: Sequence[float], smoothed: Sequence[float], min_lr: float | None = None
            ) -> tuple[float | None, float | None, float | None, int | None]:
    """``(suggestion, lr at the smoothed minimum, smoothed minimum, index of the steepest step)``.

    The suggestion is the lr where the smoothed loss falls fastest against ``log(lr)``, among the steps up
    to the minimum, leaving out the first tenth of the steps (at least 2: the moving average has seen few
    losses there) and measuring the slope over ``±max(1, n // 20)`` steps; if the loss never falls there, a
    tenth of the lr at the minimum (not below ``min_lr``).
    """
    finite = [i for i, v in enumerate(smoothed) if math.isfinite(v)]
    if not finite:
        return None, None, None, None
    i_min = min(finite, key=lambda i: smoothed[i])
    n = len(smoothed)
    skip, half = max(2, n // 10), max(1, n // 20)
    best_i, best_slope = None, 0.0
    for i in range(min(skip, i_min), i_min + 1):
        lo, hi = max(0, i - half), min(i + half, i_min)
        dx = math.log(lrs[hi]) - math.log(lrs[lo])
        if dx <= 0:
            continue
        slope = (smoothed[hi] - smoothed[lo]) / dx
        if slope < best_slope:
            best_i, best_slope = i, slope
    if best_i is not None:
        return lrs[best_i], lrs[i_min], smoothed[i_min], best_i
    fallback = lrs[i_min] / 10.0
    if min_lr is not None:
        fallback = max(fallback, min_lr)
    return fallback, lrs[i_min], smoothed[i_min], None


def plot(result: LRFindResult, path: str | os.PathLike, title: str | None = None) -> Path:
    """Save the loss-vs-lr plot (raw and smoothed loss, the suggestion and the minimum marked) as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(result.lrs, result.losses, color="tab:blue", alpha=0.35, linewidth=1.0, label="loss")
    ax.plot(result.lrs, result.smoothed, color="tab:blue", linewidth=1.8, label="smoothed loss")
    if result.suggestion is not None:
        ax.axvline(result.suggestion, color="tab:red", linestyle="--", label=f"suggested lr {result.suggestion:.3g}")
    if result.lr_at_min is not None:
        ax.axvline(result.lr_at_min, color="tab:gray", linestyle=":",
                   label=f"minimum at lr {result.lr_at_min:.3g}")
    finite = [v for v in result.losses + result.smoothed if math.isfinite(v)]
    if finite and result.min_loss is not None and result.min_loss > 0:
        # keep the diverging tail from flattening the useful part: cut the y-axis at twice the larger of the
        # first smoothed loss and the minimum
        first = result.smoothed[0] if math.isfinite(result.smoothed[0]) else result.min_loss
        top = min(max(finite), 2.0 * max(first, result.min_loss))
        bottom = min(finite)
        margin = 0.05 * (top - bottom) or 0.05 * top
        ax.set_ylim(bottom - margin, top + margin)
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    ax.set_title(title or "LR range test")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


# ------------------------------------------------------------------------------------------------------
# The recorder plugin.


class LRFinder:
    """Records ``(lr, loss)`` per optimizer step and ends the run after ``steps`` steps or on divergence.

    Registered for the range test's engine only (``initialize(plugins=[("lr_find", finder)])``). With
    ``schedule="exp"`` it also builds the scheduler (:class:`ExponentialRangeTest`).
    """

    def __init__(self, min_lr: float, max_lr: float, steps: int, schedule: str = "exp", beta: float = 0.8,
                 diverge: float = 4.0) -> None:
        _check_range(min_lr, max_lr, steps)
        if schedule not in ("exp", "linear"):
            raise ValueError(f"--schedule {schedule!r}: expected 'exp' or 'linear'.")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"--smoothing {beta!r}: expected a number in [0, 1) (0 = no smoothing).")
        if not diverge > 1.0:
            raise ValueError(f"--diverge {diverge!r}: expected a number > 1 (stop when the smoothed loss "
                             "exceeds this times the best one).")
        self.min_lr, self.max_lr, self.steps = min_lr, max_lr, steps
        self.schedule, self.beta, self.diverge = schedule, beta, diverge
        self.result = LRFindResult()
        self.engine: Any = None
        self._loss_sum: Any = None
        self._loss_count = 0
        self._lr: float | None = None
        self._avg = 0.0

    @hookimpl
    def microspeed_setup(self, engine: Any) -> None:
        """Remember the engine and expose the recorder as ``engine.plugin_state("lr_find")``."""
        self.engine = engine
        engine.set_plugin_state("lr_find", self)

    @hookimpl
    def microspeed_make_scheduler(self, optimizer: Any) -> Any:
        """With ``schedule="exp"``: the exponential range test; else let the ``scheduler`` section build it."""
        if self.schedule != "exp":
            return None
        from microspeed.cli.lr_find_schedule import ExponentialRangeTest

        return ExponentialRangeTest(optimizer, self.min_lr, self.max_lr, self.steps)

    @hookimpl
    def microspeed_before_backward(self, ctx: Any) -> None:
        """Add the micro-step's loss (as ``engine.backward`` received it)."""
        if ctx.loss is None:
            return
        loss = ctx.loss.detach().float()
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        self._loss_count += 1

    @hookimpl
    def microspeed_before_step(self, engine: Any) -> None:
        """Note the lr this optimizer step uses."""
        lrs = engine.get_lr()
        self._lr = float(lrs[0]) if lrs else None

    @hookimpl
    def microspeed_after_global_step(self, engine: Any) -> None:
        """Record the step; raise :class:`LRFindStop` when the test is over."""
        if self._loss_sum is None or self._lr is None:
            return
        import torch

        from microspeed import comm

        mean = (self._loss_sum / self._loss_count).reshape(1).to(torch.float64)
        self._loss_sum, self._loss_count = None, 0
        group = engine.data_parallel_group
        if comm.get_world_size(group) > 1:  # every rank must see the same loss, or they stop apart
            comm.all_reduce(mean, group=group)
            mean /= comm.get_world_size(group)
        loss = float(mean.item())
        r = self.result
        r.lrs.append(self._lr)
        r.losses.append(loss)
        if math.isfinite(loss):
            i = len(r.losses)
            self._avg = self.beta * self._avg + (1.0 - self.beta) * loss
            r.smoothed.append(self._avg / (1.0 - self.beta**i))
        else:
            r.smoothed.append(float("nan"))
        current = r.smoothed[-1]
        finite = [v for v in r.smoothed if math.isfinite(v)]
        if not math.isfinite(loss):
            r.stop_reason = f"diverged: the loss is {loss} at lr {self._lr:.3g}"
        elif finite and current > self.diverge * min(finite) and min(finite) > 0:
            r.stop_reason = (f"diverged: smoothed loss {current:.4g} > {self.diverge:g} x best {min(finite):.4g} "
                             f"at lr {self._lr:.3g}")
        elif len(r.losses) >= self.steps:
            r.stop_reason = "steps"
        else:
            return
        raise LRFindStop(r.stop_reason)

    def finish(self) -> LRFindResult:
        """Fill the suggestion into the result and return it."""
        r = self.result
        # a diverged (non-finite) last step is kept for the record but not smoothed into the suggestion
        r.suggestion, r.lr_at_min, r.min_loss, r.steepest_index = suggest(r.lrs, r.smoothed, self.min_lr)
        return r


# ------------------------------------------------------------------------------------------------------
# Running the user's script.


def _patched_initialize(original: Any, finder: LRFinder, config: Any, notes: list[str]) -> Any:
    from microspeed.config import load_raw

    signature = inspect.signature(original)
    used = False

    def initialize(*args: Any, **kwargs: Any) -> Any:
        nonlocal used
        if used:
            return original(*args, **kwargs)
        used = True
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        raw = load_raw(config, None) if config is not None else load_raw(
            given.get("config") if given.get("config") is not None else given.get("config_params"), given.get("args"))
        raw = dict(raw)
        old = raw.get("scheduler")
        if old is not None:
            notes.append(f"the config's scheduler {old.get('type') if isinstance(old, dict) else old!r} is "
                         "replaced by the range test")
        if given.get("lr_scheduler") is not None:
            notes.append("the script's lr_scheduler= is dropped for the range test")
        raw["scheduler"] = range_test_section(finder.min_lr, finder.max_lr, finder.steps)
        given["config"], given["config_params"], given["lr_scheduler"] = raw, None, None
        given["plugins"] = [*list(given.get("plugins") or ()), ("lr_find", finder)]
        return original(*bound.args, **bound.kwargs)

    return initialize


def run(script: str, script_args: Sequence[str] = (), config: str | None = None, min_lr: float = 1e-7,
        max_lr: float = 10.0, steps: int = 100, schedule: str = "exp", beta: float = 0.8,
        diverge: float = 4.0) -> tuple[LRFindResult, list[str]]:
    """Run ``script`` with the range test; return the result (suggestion filled in) and notes for the user.

    Raises:
        FileNotFoundError: ``script`` or ``config`` does not exist.
        RuntimeError: the script finished without an optimizer step through its engine.
    """
    if not os.path.isfile(script):
        raise FileNotFoundError(f"{script}: no such file; give the path of the training script to run.")
    if config is not None and not os.path.isfile(config):
        raise FileNotFoundError(f"--config {config}: no such file; give the ds_config JSON the script trains with.")
    finder = LRFinder(min_lr, max_lr, steps, schedule=schedule, beta=beta, diverge=diverge)
    import microspeed
    import microspeed.bootstrap

    notes: list[str] = []
    original = microspeed.bootstrap.initialize
    patched = _patched_initialize(original, finder, config, notes)
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    microspeed.initialize = microspeed.bootstrap.initialize = patched
    try:
        runpy.run_path(script, run_name="__main__")
    except LRFindStop:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
    finally:
        microspeed.initialize = microspeed.bootstrap.initialize = original
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    if finder.engine is None:
        raise RuntimeError(f"{script}: the script never called microspeed.initialize(); lr-find needs a "
                           "DeepSpeed-style script that trains through the engine.")
    if not finder.result.lrs:
        raise RuntimeError(f"{script}: the script made no optimizer step (engine.step() at a gradient "
                           "accumulation boundary, after engine.backward(loss)); nothing to plot.")
    if finder.result.stop_reason == "script ended" and len(finder.result.lrs) < steps:
        notes.append(f"the script ended after {len(finder.result.lrs)} of --steps {steps} steps; "
                     "let it train longer to cover the whole range")
    return finder.finish(), notes


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``microspeed lr-find``."""
    parser = argparse.ArgumentParser(
        prog="microspeed lr-find",
        description="LR range test: run a training script with the lr growing from --min-lr to --max-lr, plot "
                    "the loss against the lr and suggest a learning rate.",
    )
    parser.add_argument("--config", default=None,
                        help="ds_config JSON to train with (default: the config the script passes to initialize)")
    parser.add_argument("--min-lr", type=_number, default=1e-7, help="lr of the first step (default 1e-7)")
    parser.add_argument("--max-lr", type=_number, default=10.0, help="lr of the last step (default 10)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps from min to max lr (default 100)")
    parser.add_argument("--out", default="lr_find.png", help="PNG to write (default lr_find.png)")
    parser.add_argument("--schedule", choices=("exp", "linear"), default="exp",
                        help="exp: geometric growth (default); linear: DeepSpeed's LRRangeTest, min*(1+rate*step)")
    parser.add_argument("--smoothing", type=_number, default=0.8,
                        help="EMA factor of the smoothed loss, in [0, 1) (default 0.8)")
    parser.add_argument("--diverge", type=_number, default=4.0,
                        help="stop when the smoothed loss exceeds this times the best one (default 4)")
    parser.add_argument("--nproc", type=int, default=1, help="local processes, launched with torchrun (default 1)")
    parser.add_argument("script", help="the training script (it calls microspeed.initialize)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    return parser


def _launch(argv: Sequence[str], nproc: int) -> int:
    from torch.distributed import run as torchrun

    rest, skip = [], False
    for arg in argv:  # drop --nproc N / --nproc=N before the script; the children must not launch again
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        rest.append(arg)
    os.environ[LAUNCH_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    torchrun.main([f"--nproc-per-node={nproc}", "--standalone", "-m", "microspeed.cli.lr_find", *rest])
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``microspeed lr-find``: 0 when the plot was written, 1 with a message otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    opts = parser.parse_args(argv)
    try:
        _check_range(opts.min_lr, opts.max_lr, opts.steps)
        LRFinder(opts.min_lr, opts.max_lr, opts.steps, opts.schedule, opts.smoothing, opts.diverge)
    except ValueError as exc:
        parser.error(str(exc))
    if opts.nproc < 1:
        parser.error(f"--nproc {opts.nproc}: expected an integer >= 1.")
    if not os.path.isfile(opts.script):
        parser.error(f"{opts.script}: no such file; give the path of the training script to run.")
    if opts.config is not None and not os.path.isfile(opts.config):
        parser.error(f"--config {opts.config}: no such file; give the ds_config JSON the script trains with.")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("microspeed lr-find: needs matplotlib to draw the plot. Run `pip install matplotlib` "
              "(or `pip install 'microspeed[monitor]'`).", file=sys.stderr)
        return 1
    if opts.nproc > 1 and not os.environ.get(LAUNCH_ENV) and "LOCAL_RANK" not in os.environ:
        return _launch(argv, opts.nproc)

    result, notes = run(opts.script, opts.script_args, config=opts.config, min_lr=opts.min_lr, max_lr=opts.max_lr,
                        steps=opts.steps, schedule=opts.schedule, beta=opts.smoothing, diverge=opts.diverge)
    from microspeed import comm

    if comm.get_rank() == 0:
        out = plot(result, opts.out, title=f"LR range test: {os.path.basename(opts.script)}")
        print(report(result, opts.min_lr, opts.max_lr, opts.steps, opts.schedule, notes, out))
    _finish_distributed()
    return 0


def _finish_distributed() -> None:
    """Under torchrun: wait for rank 0's plot, then close the process group on every rank together (a rank that
    exits with gloo's threads still running can abort with "terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def report(result: LRFindResult, min_lr: float, max_lr: float, steps: int, schedule: str,
           notes: Sequence[str] = (), out: str | os.PathLike | None = None) -> str:
    """The text ``microspeed lr-find`` prints: range, why it stopped, minimum and suggestion."""
    lines = [f"lr-find: {len(result.lrs)} steps, lr {min_lr:.3g} -> {max_lr:.3g} over {steps} steps ({schedule})"]
    lines += [f"lr-find: note: {note}" for note in notes]
    if result.stop_reason.startswith("diverged"):
        lines.append(f"lr-find: stopped early at step {len(result.lrs)}: {result.stop_reason}")
    if result.lr_at_min is not None:
        lines.append(f"lr-find: minimum smoothed loss {result.min_loss:.4g} at lr {result.lr_at_min:.3g} "
                     f"(a tenth of it: {result.lr_at_min / 10:.3g})")
    if result.suggestion is not None:
        how = ("steepest descent of the smoothed loss" if result.steepest_index is not None
               else "a tenth of the lr at the minimum: the loss never fell")
        lines.append(f"lr-find: suggested lr: {result.suggestion:.3g} ({how})")
    if out is not None:
        lines.append(f"lr-find: wrote {out}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
