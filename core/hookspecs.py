"""Every hook of microspeed: the contract plugins are written against.

Plugins implement these with :data:`microspeed.hookimpl`. Hooks are grouped by lifecycle phase.
Three kinds, as pytest uses pluggy:

* **setup** hooks run once per engine, inside :func:`microspeed.initialize`;
* **"who does it"** hooks are ``firstresult``: the first non-``None`` answer wins. The core ships
  a default answer as a built-in ``trylast`` plugin; a feature plugin answers first when enabled;
* **notifications** return nothing (their return value is ignored).

A few hooks are *chains* (:data:`CHAINS`): each implementation gets the previous one's result as
its value argument (``None`` means "unchanged") and the call returns the last value. Chains are
ordinary pluggy hooks — the plugin manager runs them through pluggy's own call loop — so hook
wrappers (``wrapper=True``, which see the final value and may replace it) and tracing see them
as any other hook.

"Who does it" hooks the lifecycle cannot do without are *required* (:data:`REQUIRED`): at load a
required hook nobody implements is refused (naming the disabled built-in that answered it), and
at call time an unanswered one raises :class:`microspeed.PluginError` naming the hook, the plugins
asked and how to get an answer — never a silent no-op.

Implementations may accept any subset of a hook's arguments, by name (pluggy's rule).

Order of one training step with gradient accumulation 2 (``engine(x)``, ``engine.backward(l)``,
``engine.step()`` twice)::

    before_forward, after_forward, before_backward, scale_loss*, backward, after_backward,
    before_forward, after_forward, before_backward, scale_loss*, backward, after_backward,
    reduce_gradients, before_step, optimizer_step (→ clip_gradients), after_step

(``*`` a chain). ``before_step``/``optimizer_step``/``after_step`` fire only at the gradient
accumulation boundary; ``engine.step()`` between boundaries only counts the micro-step.

**Roles.** Some work has a built-in default that must stand down entirely — not only lose a
``firstresult`` race — when a plugin takes it over (autograd hooks installed at set-up, master
weights built in ``wrap_optimizer``). A plugin takes a role with ``engine.claim(role, name)`` in
:func:`microspeed_setup`, or later for part of a run and hands it back with ``engine.release(role,
name)``; defaults check ``engine.owner(role)``. The roles are :class:`microspeed.capabilities.Role`;
what plugins state about themselves for others to ask are capabilities
(:mod:`microspeed.capabilities`, hook :func:`microspeed_capabilities`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from microspeed.capabilities import Capabilities, Capability
    from microspeed.compositions import Feature, Refusal
    from microspeed.config import Config, Section
    from microspeed.engine import Engine, StepContext
    from microspeed.gradients import NormRule
    from microspeed.topology import Topology

PROJECT = "microspeed"

hookspec = pluggy.HookspecMarker(PROJECT)
"""Marker for hook specifications (used only in this module and by plugins adding hooks)."""

CHAINS: dict[str, str] = {}
"""Chain hooks: ``hook name -> the argument that carries the value from one implementation to the next``."""

REQUIRED: dict[str, str] = {}
"""Required "who does it" hooks: ``hook name -> when it is called`` (an unanswered call is an error)."""


def chain(value_arg: str) -> Any:
    """Mark a hookspec as a chain whose value travels in ``value_arg`` (see :data:`CHAINS`)."""

    def mark(fn: Any) -> Any:
        CHAINS[fn.__name__] = value_arg
        return fn

    return mark


def required(when: str) -> Any:
    """Mark a ``firstresult`` hookspec as required; ``when`` says when the engine calls it (see :data:`REQUIRED`)."""

    def mark(fn: Any) -> Any:
        REQUIRED[fn.__name__] = when
        return fn

    return mark

hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marker for hook implementations: ``@microspeed.hookimpl`` on a plugin's method or function."""


# --------------------------------------------------------------------------------------- setup


@hookspec
def microspeed_plugins_loaded(plugins: Any) -> None:
    """Every plugin of this engine is registered; ``plugins`` is the :class:`PluginManager`.

    Fires first, before the config is parsed. Tracing attaches its hook-call monitor here.
    """


@hookspec
def microspeed_config_sections() -> dict[str, Section]:
    """Name the ds_config sections (or top-level keys) this plugin owns, with their schema.

    Collected from every plugin. Returns ``{name: Section}`` for nested sections, or
    ``{name: Field}`` for a top-level scalar key. Two plugins claiming one name is an error at
    ``initialize()``. Keys in no claimed section are refused by :mod:`microspeed.config`.
    """


@hookspec
def microspeed_configure(config: Config, world_size: int) -> None:
    """Read the validated config; decide whether this plugin is active.

    Fires once per engine, after validation and after the topology is made (so the batch triad
    is resolved against its data-parallel size). ``config`` is a
    :class:`microspeed.config.Config`; a plugin may raise :class:`microspeed.ConfigError` for a
    value that only it can judge.
    """


@hookspec
def microspeed_capabilities(config: Config) -> list[Capability] | None:
    """Collected: the typed capabilities this active plugin provides (:mod:`microspeed.capabilities`).

    Fires once per engine right after :func:`microspeed_configure`. Every later hook (starting with
    :func:`microspeed_conflicts`) can ask ``capabilities.get(Kind)`` / ``engine.capabilities.get(Kind)``
    instead of reading another plugin's config section. Two plugins providing one kind is an error.
    """


@hookspec
def microspeed_conflicts(config: Config, capabilities: Capabilities) -> list[tuple[str, str]] | None:
    """Declare what this active plugin cannot be combined with.

    Return a list of ``(config_key, reason)`` pairs: if ``config_key`` (a dotted path) is set in
    the config, ``initialize()`` refuses with a message naming this plugin, the key and the
    reason. ``capabilities`` holds what the other plugins provide (a key to name comes with the
    capability, e.g. :attr:`GradientPartitioning.config_key`). Collected from every plugin.
    """


@hookspec
def microspeed_features() -> list[Feature] | None:
    """Collected: the features this plugin provides (:class:`microspeed.compositions.Feature`), active or not.

    Not called by ``initialize()``: :func:`microspeed.compositions.composition_matrix` gathers the installed
    plugins' answers for ``microspeed plugins --matrix`` and ``docs/compositions.md``. Feature names are
    global; two plugins declaring one name is a :class:`microspeed.PluginError`.
    """


@hookspec
def microspeed_refusals() -> list[Refusal] | None:
    """Collected: the pairs of features this plugin refuses (:class:`microspeed.compositions.Refusal`).

    Each names at least one of this plugin's own features; both must be declared by an installed plugin
    (else :class:`microspeed.PluginError`). A declared pair must be what ``initialize()`` refuses, with
    :meth:`Refusal.message` as the text; lifting a refusal means deleting its declaration.
    """


@required("always, at initialize()")
@hookspec(firstresult=True)
def microspeed_make_topology(config: Config, world_size: int, mpu: Any, model: torch.nn.Module) -> Topology | None:
    """Build the process topology (which ranks form the data-parallel group, and so on).

    Who does it. ``mpu`` is what the user passed as ``initialize(mpu=...)`` (Megatron-style
    object) or ``None``; ``model`` is the user's model, untouched (a model that was built for a
    process grid, such as a pipeline module, carries its grid). Default (built-in
    ``data_parallel``): every rank is one data-parallel replica, or the groups ``mpu`` names.
    The data-parallel world size it reports is the one the batch triad is resolved against.
    """


@hookspec
def microspeed_adjust_batch(config: Config, dp_world_size: int) -> None:
    """Notification: set the batch triad for this data-parallel size, before the core resolves it.

    Fires once per engine, right after :func:`microspeed_make_topology` (``dp_world_size`` is its
    data-parallel size) and before the batch triad (``train_batch_size = train_micro_batch_size_per_gpu
    * gradient_accumulation_steps * dp_world_size``) is resolved and checked. A plugin that derives
    the batch from the world size (the built-in ``elasticity``: DeepSpeed's elastic batch sizes)
    writes the three keys with ``config.set``; the core then resolves and checks them as it does a
    user's. Raise :class:`microspeed.ConfigError` naming the key to refuse.
    """

@hookspec
def microspeed_setup(engine: Engine) -> None:
    """The engine exists (config, topology, plugin manager); attach per-engine state.

    Fires before the model is transformed. A plugin keeps its per-engine state on the engine
    with ``engine.set_plugin_state(name, obj)``, never in module globals.
    """


@chain("model")
@hookspec
def microspeed_transform_model(engine: Engine, model: torch.nn.Module) -> torch.nn.Module | None:
    """Chain: wrap, cast or modify the model; return the new model or ``None`` for unchanged.

    Runs in call order (``tryfirst`` implementations first). Used for precision casts,
    activation checkpointing, kernel replacement, parallel wrappers. Fires before the optimizer
    is built, so the optimizer sees the final parameters.
    """


@hookspec
def microspeed_after_model_ready(engine: Engine, model: torch.nn.Module) -> None:
    """The model is final (``engine.module``); install module or autograd hooks here.

    The data-parallel plugin installs its gradient-bucket hooks here, for example.
    """


@hookspec
def microspeed_engine_api(engine: Engine) -> dict[str, Any] | None:
    """Name the DeepSpeed engine methods and attributes this plugin answers for ``engine``.

    Collected once, right after :func:`microspeed_setup`. Returns ``{name: value}``: a callable
    becomes a method of the engine (``engine.zero_optimization_stage()``), anything else an
    attribute. Clients such as Hugging Face Accelerate and Lightning call many such accessors;
    each plugin answers for what it owns. When two plugins name the same attribute the one
    called first by pluggy wins (built-in defaults are ``trylast``). Names the engine defines
    itself are never overridden.
    """


@required("when the config has an 'optimizer' section")
@hookspec(firstresult=True)
def microspeed_make_optimizer(engine: Engine, params: list[Any], config: Config) -> Any | None:
    """Who builds the optimizer from the ds_config ``optimizer`` section.

    Not called when the client passed an optimizer object or factory. ``params`` are the
    ``model_parameters`` given to ``initialize()`` (or the model's trainable parameters).
    """


@chain("optimizer")
@hookspec
def microspeed_wrap_optimizer(engine: Engine, optimizer: Any) -> Any | None:
    """Chain: adjust or wrap the optimizer (for example swap in fp32 master parameters).

    Return the optimizer to use from now on, or ``None`` for unchanged.
    """


@required("when the config has a 'scheduler' section")
@hookspec(firstresult=True)
def microspeed_make_scheduler(engine: Engine, optimizer: Any, config: Config) -> Any | None:
    """Who builds the LR scheduler from the ds_config ``scheduler`` section (``None``: none).

    Not called when the client passed a scheduler object or factory.
    """


@required("when initialize() is given training_data")
@hookspec(firstresult=True)
def microspeed_make_dataloader(engine: Engine, dataset: Any, collate_fn: Any) -> Any | None:
    """Who turns ``training_data`` into the training data loader."""


@hookspec
def microspeed_initialized(engine: Engine) -> None:
    """Notification: the engine is complete (module, optimizer, scheduler, data loader), the last step of
    ``initialize()``; a plugin may restore state here (the built-in ``checkpointing``: ``checkpoint.auto_resume_dir``).

    No agreement collective follows it: an implementation that can fail on some ranks only agrees on the outcome
    itself (all-gathers its error) before returning, so no rank is left waiting in a later collective.
    """


# ---------------------------------------------------------------------------------- micro-step


@chain("batch")
@hookspec
def microspeed_micro_batch(engine: Engine, batch: Any, index: int) -> Any | None:
    """Chain: a schedule that draws its own micro-batches (a pipeline's ``train_batch``/``eval_batch``) drew
    micro-batch ``index`` (0-based within the batch) from the data iterator.

    Return the micro-batch changed (the sequence curriculum cuts inputs and labels to its current length,
    on every stage alike) or ``None`` for unchanged. ``engine.module.training`` says whether the schedule
    trains. Not called by ``engine(x)``: there :func:`microspeed_before_forward` sees the arguments.
    """


@hookspec
def microspeed_before_forward(engine: Engine, ctx: StepContext) -> None:
    """Notification: the engine is about to run the model on ``ctx.args`` / ``ctx.kwargs``.

    A listener may replace ``ctx.args`` / ``ctx.kwargs`` (curriculum truncation, casts).
    """


@hookspec
def microspeed_after_forward(engine: Engine, ctx: StepContext) -> None:
    """Notification: the model ran; ``ctx.outputs`` holds what it returned (may be replaced)."""


@hookspec
def microspeed_no_sync(engine: Engine) -> None:
    """Notification: ``engine.no_sync()`` is being entered (gradient reduction will be skipped).

    A plugin that cannot skip reduction raises here, on entry, as DeepSpeed asserts (ZeRO stages 2
    and 3 reduce-scatter gradients as backward produces them). Raise
    :class:`microspeed.errors.EngineUsageError` (also an ``AssertionError``).
    """


@hookspec
def microspeed_before_backward(engine: Engine, ctx: StepContext) -> None:
    """Notification: a backward pass begins; ``ctx.loss`` is the unscaled loss.

    ``ctx.loss`` is ``None`` for a backward that starts from a received gradient (a pipeline stage
    before the last).
    """


@chain("loss")
@hookspec
def microspeed_scale_loss(engine: Engine, loss: torch.Tensor) -> torch.Tensor | None:
    """Chain: scale the loss before backward (gradient accumulation, fp16 loss scale).

    Return the scaled loss or ``None`` for unchanged.
    """


@required("on every engine.backward()")
@hookspec(firstresult=True)
def microspeed_backward(engine: Engine, loss: torch.Tensor, retain_graph: bool) -> bool | None:
    """Who runs the backward pass on the (scaled) loss. Return ``True`` when done."""


@hookspec
def microspeed_after_backward(engine: Engine, ctx: StepContext) -> None:
    """Notification: gradients of this micro-step exist (not yet reduced across ranks)."""


@hookspec
def microspeed_next_pass(engine: Engine, current: tuple[str, int], upcoming: tuple[str, int] | None) -> None:
    """Notification: a runner that knows its schedule (a pipeline) starts a compute pass and says what follows.

    Fired right before the pass's ``before_forward`` / ``before_backward``. ``current`` is the pass now starting
    and ``upcoming`` the next compute pass this rank runs, each ``(kind, chunk)`` with ``kind`` ``"forward"``
    or ``"backward"`` and ``chunk`` the part of the model it runs (a pipeline's chunk; 0 with one chunk);
    ``upcoming`` is ``None`` when no pass follows before the optimizer step (or the end of the batch).
    Data-parallel ranks that run the same schedule get the same sequence. A plugin that gathers
    parameters (ZeRO-3) prefetches the next pass's first parameters and keeps those the next pass needs; a
    gradient reducer reduces only the current chunk's gradients. Without it (``engine(x)`` /
    ``engine.backward``), a forward with gradients is followed by its backward.
    """


@hookspec(firstresult=True)
def microspeed_pass_parameters(engine: Engine) -> list[list[torch.nn.Parameter]] | None:
    """Who knows which parameters each chunk of a schedule uses: one list per chunk, indexed as
    :func:`microspeed_next_pass` names chunks (a pipeline with ``num_chunks > 1``).

    Asked once, when the optimizer is wrapped. A plugin that buckets gradients keeps each bucket within
    one chunk and reduces, at the end of a chunk's backward, only that chunk's buckets. ``None``: one chunk.
    """


@hookspec(firstresult=True)
def microspeed_gradient_buffers(engine: Engine) -> list[torch.Tensor] | None:
    """Who holds the accumulated gradients, when they are not the model parameters' ``.grad``.

    ``None`` (the default) means ``p.grad`` of the model's parameters. A plugin that
    accumulates elsewhere (fp32 accumulation of a bf16 model) returns its buffers; the
    reducer then reduces those at the boundary instead of overlapping with backward.
    """


@required("at the accumulation boundary, when gradients are reduced")
@hookspec(firstresult=True)
def microspeed_reduce_gradients(engine: Engine) -> bool | None:
    """Who reduces gradients across the data-parallel group at the accumulation boundary.

    Fires at the boundary, right after the last micro-step's backward. Return ``True`` when
    done. Default: the built-in bucketed all-reduce (which may already have launched buckets
    from autograd hooks during backward and now waits for them).
    """


# ------------------------------------------------------------------------------- whole batch


@required("on engine.train_batch()")
@hookspec(firstresult=True)
def microspeed_train_batch(engine: Engine, data_iter: Any) -> torch.Tensor | None:
    """Who runs one training batch: ``gradient_accumulation_steps`` micro-batches and the step.

    Called by ``engine.train_batch(data_iter)``; returns the mean loss over the micro-batches (a
    detached 0-d tensor). Default (built-in ``batch_loop``): for each micro-batch
    ``next(data_iter)``, forward, ``engine.backward``, ``engine.step()`` — so every micro-step
    hook fires as in a hand-written loop. A pipeline plugin answers with its schedule.
    """


@required("on engine.eval_batch()")
@hookspec(firstresult=True)
def microspeed_eval_batch(engine: Engine, data_iter: Any, return_logits: bool, compute_loss: bool,
                          reduce_output: str | None, bcast_loss: bool, num_micro_batches: int | None) -> Any:
    """Who evaluates one batch without gradients; called by ``engine.eval_batch(...)``.

    Returns the loss reduced over the micro-batches as ``reduce_output`` says (``"avg"`` or
    ``None`` for the list), or ``(loss, logits)`` with ``return_logits``. Default: the built-in
    ``batch_loop``'s micro-batch loop under ``torch.no_grad()``.
    """


# -------------------------------------------------------------------------------------- step


@hookspec
def microspeed_before_step(engine: Engine) -> None:
    """Notification: the accumulation boundary was reached; the optimizer is about to step."""


@required("at the accumulation boundary, in engine.step()")
@hookspec(firstresult=True)
def microspeed_optimizer_step(engine: Engine) -> StepOutcome | None:
    """Who steps the optimizer. Returns a :class:`StepOutcome` (applied or skipped, grad norm).

    Default: clip (through :func:`microspeed_clip_gradients`), then ``optimizer.step()``.
    Mixed precision answers first: unscale, check overflow (skip and lower the scale), clip,
    step the fp32 masters, copy back. Whoever answers asks ``engine.grad_norm.finite(norm)`` between
    the norm and the step, and skips a non-finite one with ``StepOutcome(applied=False, nonfinite=True)``
    (the same answer on every rank): bad numbers never train.
    """


@required("when the optimizer step measures the gradient norm")
@hookspec(firstresult=True)
def microspeed_clip_gradients(engine: Engine, grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Who computes the global gradient norm over ``grads`` and clips them in place.

    ``grads`` are unscaled. Returns the total norm before clipping (a 0-d tensor). The default
    reads ``gradient_clipping`` from the config (0 = measure only) and measures with the kernel's
    one norm (``engine.grad_norm``, which applies every plugin's :func:`microspeed_grad_norm_rules`).
    """


@hookspec
def microspeed_grad_norm_rules(engine: Engine) -> dict[str, NormRule] | None:
    """Collected: how this plugin's parameters count in the global gradient norm, ``{fqn: NormRule}``.

    Asked once per engine, at the first norm (:mod:`microspeed.gradients`). Name only parameters that
    differ from the default (every gradient's squares summed over the topology's model-parallel
    group): ``NormRule(skip=True)`` for a copy another rank counts, ``NormRule(groups=(g,))`` for
    squares also summed over ``g``. The kernel sums once and clips once.
    """


@hookspec
def microspeed_after_step(engine: Engine, outcome: StepOutcome) -> None:
    """Notification: the optimizer stepped (or skipped, see ``outcome.applied``).

    The LR scheduler has already advanced; ``engine.global_steps`` has not yet.
    """


@hookspec
def microspeed_after_global_step(engine: Engine) -> None:
    """Notification: counters advanced (``engine.global_steps`` is the new value, ``engine.micro_steps`` counts the
    micro-step that ended the window); log here."""


# -------------------------------------------------------------------------------- checkpoint


@required("on engine.save_checkpoint()")
@hookspec(firstresult=True)
def microspeed_save_checkpoint(engine: Engine, save_dir: str, tag: str | None, client_state: dict | None,
                               save_latest: bool, exclude_frozen_parameters: bool) -> bool | None:
    """Who writes a checkpoint of ``engine`` (``engine.save_checkpoint``'s arguments); return ``True``.

    Default: the built-in ``checkpointing`` (:func:`microspeed.checkpoint.save`: DCP shards + a msgpack
    manifest), which fires the checkpoint notifications and collects every plugin's state.
    """


@required("on engine.load_checkpoint()")
@hookspec(firstresult=True)
def microspeed_load_checkpoint(engine: Engine, load_dir: str, tag: str | None, load_module_strict: bool,
                               load_optimizer_states: bool, load_lr_scheduler_states: bool,
                               load_module_only: bool, load_rng_state: bool,
                               verify: bool) -> tuple[str | None, dict] | None:
    """Who reads a checkpoint into ``engine``; returns ``(path, client_state)`` (``(None, {})``: none found).
    ``verify``: refuse tensors the checkpoint carries no checksums for (``False``: the caller trusts the files).

    Default: the built-in ``checkpointing`` (:func:`microspeed.checkpoint.load`, any world size).
    """


@required("on engine.save_16bit_model()")
@hookspec(firstresult=True)
def microspeed_save_16bit_model(engine: Engine, save_dir: str, save_filename: str,
                                exclude_frozen_parameters: bool) -> bool | None:
    """Who writes the module's whole state dict (training dtype) for ``engine.save_16bit_model``; a bool.

    Default: the built-in ``checkpointing`` (:func:`microspeed.checkpoint.save_16bit_model`).
    """


@hookspec
def microspeed_before_checkpoint_save(engine: Engine, save_dir: str, tag: str) -> None:
    """Notification: every rank is about to write a checkpoint of ``engine``; nothing was read yet.

    A plugin whose replicas may disagree between steps (0/1 Adam's local steps) brings them
    together here, so that the checkpoint holds one consistent state.
    """


@hookspec
def microspeed_checkpoint_state(engine: Engine) -> dict[str, Any] | None:
    """Collected: this plugin's state to save in a checkpoint, ``{plugin_name: state}``.

    ``state`` is a tree of dicts, lists and tuples. Its tensors are written through
    ``torch.distributed.checkpoint`` under ``plugins/<plugin_name>/<path>`` (key them by
    parameter name, so the checkpoint reloads under another topology); its small Python values
    go into the msgpack manifest, as data: ``None``, bools, ints, floats, strings, bytes, torch
    dtypes and numpy numbers (any other object, a ``set`` or an ``Enum``, is refused at save: store
    its plain value). The state is taken to be the same on every rank (tensors are
    de-duplicated across ranks); see :mod:`microspeed.checkpoint`.
    """


@hookspec
def microspeed_load_checkpoint_state(engine: Engine, states: dict[str, Any]) -> None:
    """Restore this plugin's state from ``states`` (the dict of every plugin's saved state).

    Fires after the module, the optimizer and the scheduler were restored; not with
    ``load_module_only=True``.
    """


@hookspec(firstresult=True)
def microspeed_checkpoint_module_tensors(engine: Engine, saving: bool) -> dict[str, Any] | None:
    """Who presents the module's state (keyed as ``module.state_dict()``) to checkpoints.

    The tensors returned are written on save and filled in place on load, so a plugin that
    partitions parameters returns sharded tensors (:func:`microspeed.checkpoint.flat_shard`)
    over its own shards. ``saving``: for a save, where a sharded tensor's piece may also be an
    :class:`microspeed.checkpoint.OnDemandPiece` (read when written: a shard kept in a file); on load
    every piece must be a tensor. Default (``None``): ``engine.module.state_dict()``.
    """


@hookspec
def microspeed_checkpoint_placements(engine: Engine) -> dict[str, Any] | None:
    """Collected: ``{fqn: Placement}`` for parameters this rank holds only a piece of.

    A tensor-parallel shard is a box of its full tensor. Given its
    :class:`microspeed.checkpoint.Placement`, every checkpoint tensor keyed by that name with the
    piece's shape (``model/<fqn>``, ``master/<fqn>``, ``optim/<fqn>/<state>``) is written as a piece
    of the full tensor and read back as the piece the loading rank holds — so the checkpoint loads
    under another split, or none.
    """


@required("when a checkpoint with an optimizer is saved")
@hookspec(firstresult=True)
def microspeed_save_optimizer_state(engine: Engine, tensors: dict[str, Any]) -> dict[str, Any] | None:
    """Who writes the optimizer into a checkpoint.

    Puts tensors into ``tensors`` under ``optim/<fqn>/<name>`` (and ``master/<fqn>`` for fp32
    masters), keyed by parameter name with the parameter's full shape (sharded tensors allowed),
    and returns the manifest part ``{"class", "param_groups" (with FQNs), "state", "masters"}``.
    Default: the built-in ``optimizers`` plugin, from ``optimizer.state_dict()``.
    """


@required("when a checkpoint is loaded into an engine with an optimizer")
@hookspec(firstresult=True)
def microspeed_load_optimizer_state(engine: Engine, saved: dict[str, Any] | None, reader: Any, load_states: bool,
                                    strict: bool, after: list[Any]) -> bool | None:
    """Who plans reading the optimizer from a checkpoint; return ``True`` when planned.

    ``saved`` is the manifest part :func:`microspeed_save_optimizer_state` returned (``None``
    if the checkpoint has no optimizer). Register read targets on ``reader`` (a
    :class:`microspeed.checkpoint.Reader`); append callables to ``after``, run once the tensors
    are read. fp32 masters are restored even when ``load_states`` is false.
    """


@hookspec(firstresult=True)
def microspeed_consolidated_state_dict(engine: Engine) -> dict[str, Any] | None:
    """Who returns the module's whole state dict on rank 0 for ``save_16bit_model``.

    Every rank calls it (gathering may be collective); the engine writes rank 0's answer. Other ranks
    return ``{}``, or tensors only they hold (the first copies of a replica group's parameters, such as
    experts) for a wrapper to bring to rank 0. Default: ``engine.module.state_dict()``.
    Return ``{"__skip__": reason}`` to refuse (the engine then warns and returns ``False``).
    """


@hookspec
def microspeed_optimizer_param_names(engine: Engine) -> dict[int, str] | None:
    """Collected: ``{id(tensor): fqn}`` for optimizer parameters that are not ``engine.module``'s own.

    A plugin that swaps other tensors into the optimizer's param groups (fp32 master copies,
    say) names each by the model parameter it stands for, so that the optimizer state and the
    master weights are saved keyed by parameter name and reload under another precision or
    topology.
    """


# ------------------------------------------------------------------------------------- any


@hookspec
def microspeed_destroy(engine: Engine) -> None:
    """``engine.destroy()`` (DeepSpeed's): the engine trains no more. Remove every hook this plugin put on the model,
    its parameters or torch — a hook on a parameter is held from outside Python's collector, so one whose closure
    reaches the engine keeps the engine, its buffers and the model alive after the user drops them — finish what is
    in flight, stop this plugin's threads and close its files (swap files are removed). Called once per engine; the
    engine then drops the plugins' states, its optimizer, scheduler and data loader."""


@hookspec
def microspeed_on_exception(engine: Engine | None, exc: BaseException, phase: str) -> None:
    """Notification: ``phase`` (``"forward"``, ``"backward"``, ``"step"``, ...) raised ``exc``."""


class StepOutcome:
    """What an optimizer step did: whether it was applied, and the global gradient norm.

    ``grad_norm`` may be a 0-d tensor (read it lazily, so that a GPU step needs no host sync) or
    a float, or ``None`` when it was not measured. ``nonfinite``: the step was skipped because the
    loss or the gradient norm was not finite (``engine.grad_norm.finite``) — not an fp16 overflow,
    which the loss scaler answers by lowering the scale; the built-in ``gradient_clipping`` plugin logs
    it and ends the job after ``max_consecutive_nonfinite_steps`` such steps in a row.
    """

    __slots__ = ("applied", "grad_norm", "nonfinite")

    def __init__(self, applied: bool, grad_norm: float | None = None, nonfinite: bool = False) -> None:
        self.applied = applied
        self.grad_norm = grad_norm
        self.nonfinite = nonfinite

    def __repr__(self) -> str:
        extra = ", nonfinite=True" if self.nonfinite else ""
        return f"StepOutcome(applied={self.applied}, grad_norm={self.grad_norm}{extra})"
