"""The engine: DeepSpeed's user API over the training lifecycle, emitting hooks.

The engine knows the order of things — forward, backward, gradient reduction at the
accumulation boundary, optimizer step, counters — and nothing about how any of them is done:
each "how" is a hook answered by a plugin (see :mod:`microspeed.hookspecs`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from microspeed.capabilities import Capabilities, Role
from microspeed.config import Config
from microspeed.data import RepeatingLoader
from microspeed.errors import ConfigError, EngineUsageError
from microspeed.gradients import GradNorm
from microspeed.hookspecs import StepOutcome
from microspeed.plugins import PluginManager
from microspeed.topology import Topology


@dataclass
class StepContext:
    """What one micro-step carries between hooks; listeners may replace fields.

    ``args``/``kwargs`` go into the model, ``outputs`` come out, ``loss`` is what
    ``engine.backward`` received (unscaled). ``scale_wrt_gas`` mirrors DeepSpeed's argument.
    ``boundary``: this micro-step ends an accumulation window; ``reduce``: its gradients are
    reduced across ranks after backward (boundary, outside ``no_sync``, ``allreduce_gradients``).
    """

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    outputs: Any = None
    loss: torch.Tensor | None = None
    scale_wrt_gas: bool = True
    boundary: bool = False
    reduce: bool = False


class Engine(torch.nn.Module):
    """A model under training: call it like the module, then ``backward(loss)`` and ``step()``.

    Made by :func:`microspeed.initialize`. Unknown attributes are looked up on the wrapped
    module, as DeepSpeed's engine does.
    """

    def __init__(self, plugins: PluginManager, config: Config, topology: Topology, model: torch.nn.Module,
                 capabilities: Capabilities | None = None):
        super().__init__()
        self.module = model
        self.plugins = plugins
        self.hook = plugins.hook
        self.config = config
        self.topology = topology
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.training_dataloader: Any = None
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.metrics: dict[str, Any] = {}
        self.ctx = StepContext()
        self._plugin_state: dict[str, Any] = {}
        self._owners: dict[Role, str] = {}
        self.capabilities = capabilities if capabilities is not None else Capabilities()
        """What the plugins stated about themselves (:mod:`microspeed.capabilities`)."""
        self.grad_norm = GradNorm(self)
        """The one global-gradient-norm mechanism (:mod:`microspeed.gradients`)."""
        self._last_outcome = StepOutcome(applied=False)
        self._inside_no_sync = False
        self._params: tuple[torch.nn.Module, list[torch.nn.Parameter]] | None = None
        self._data_iterator: Any = None
        self._api: dict[str, Any] = {}
        self._boundary: bool | None = None

    # -- plugin state --------------------------------------------------------------------

    def set_plugin_state(self, name: str, state: Any) -> None:
        """Attach a plugin's per-engine state object under ``name``."""
        self._plugin_state[name] = state

    def plugin_state(self, name: str, default: Any = None) -> Any:
        """The state object a plugin attached under ``name`` (``default`` if none)."""
        return self._plugin_state.get(name, default)

    def drop_plugin_states(self) -> None:
        """``destroy()``: forget the plugins' states and the last context (its loss's graph holds plugins' hooks)."""
        self._plugin_state.clear()
        self.ctx = StepContext()

    def claim(self, role: Role | str, plugin: str) -> None:
        """Record that ``plugin`` takes over ``role`` (a :class:`~microspeed.capabilities.Role`; else PluginError).

        Plugins claim in ``microspeed_setup`` (or later, for part of a run, handing the role back
        with :meth:`release`); a default implementation of the role stands down
        when :meth:`owner` names another plugin. Two plugins claiming one role is a
        :class:`ConfigError` naming both.
        """
        role = Role.parse(role)
        holder = self._owners.get(role)
        if holder is not None and holder != plugin:
            raise ConfigError(f"plugins {holder!r} and {plugin!r} both take over {role.value!r}; disable one of them "
                              f"(\"plugins\": {{\"disable\": [...]}}) or turn off its config section.")
        self._owners[role] = plugin

    def release(self, role: Role | str, plugin: str) -> None:
        """``plugin`` hands ``role`` back to the built-in default (a no-op if it does not hold it).

        A plugin may take a role over for part of a run only: the 1-bit optimizers reduce
        gradients themselves after their warm-up and hand reduction back when a checkpoint of
        the warm-up stage is loaded. Defaults read :meth:`owner` each step, not only at set-up.
        """
        role = Role.parse(role)
        if self._owners.get(role) == plugin:
            del self._owners[role]

    def owner(self, role: Role | str) -> str | None:
        """The plugin that claimed ``role``, or ``None`` when the built-in default does it."""
        return self._owners.get(Role.parse(role))

    # -- batch triad & counters ----------------------------------------------------------

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.config["train_batch_size"]

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per forward/backward on one rank."""
        return self.config["train_micro_batch_size_per_gpu"]

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.config["gradient_accumulation_steps"]

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-step is the last one before an optimizer step.

        The value :meth:`set_gradient_accumulation_boundary` set, else the micro-step counter's.
        """
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Override the boundary, as DeepSpeed's engine does (Accelerate drives accumulation this way).

        From now on :meth:`is_gradient_accumulation_boundary` returns ``is_boundary`` — so
        ``backward`` reduces gradients and ``step`` steps the optimizer only where it is true —
        until it is set again. An optimizer that tracks the boundary itself is told too.
        """
        self._boundary = bool(is_boundary)
        if hasattr(self.optimizer, "set_gradient_accumulation_boundary"):
            self.optimizer.set_gradient_accumulation_boundary(self._boundary)

    @property
    def data_parallel_group(self) -> Any:
        """The data-parallel process group (``None`` = world)."""
        return self.topology.data_parallel_group

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter (CPU for a model without any)."""
        p = next(self.module.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    # -- forward / backward / step -------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on one micro-batch (hooks ``before_forward`` / ``after_forward``)."""
        self.ctx = ctx = StepContext(args=args, kwargs=kwargs, boundary=self.is_gradient_accumulation_boundary())
        with self._phase("forward"):
            self.hook.microspeed_before_forward(engine=self, ctx=ctx)
            ctx.outputs = self.module(*ctx.args, **ctx.kwargs)
            self.hook.microspeed_after_forward(engine=self, ctx=ctx)
        return ctx.outputs

    def backward(
        self,
        loss: torch.Tensor,
        allreduce_gradients: bool = True,
        release_loss: bool = False,
        retain_graph: bool = False,
        scale_wrt_gas: bool = True,
    ) -> torch.Tensor:
        """Backward on ``loss`` (scaled for gradient accumulation and loss scaling).

        At the accumulation boundary (and outside :meth:`no_sync`) gradients are then reduced
        across the data-parallel group. Returns the loss divided by the accumulation steps
        (unless ``scale_wrt_gas=False``), as DeepSpeed does.
        """
        del release_loss
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(f"engine.backward(loss): expected a scalar tensor, got {type(loss).__name__}"
                            f"{'' if not isinstance(loss, torch.Tensor) else f' of shape {tuple(loss.shape)}'}.")
        ctx = self.ctx
        ctx.loss, ctx.scale_wrt_gas = loss, scale_wrt_gas
        ctx.boundary = self.is_gradient_accumulation_boundary()
        ctx.reduce = ctx.boundary and allreduce_gradients and not self._inside_no_sync
        with self._phase("backward"):
            self.hook.microspeed_before_backward(engine=self, ctx=ctx)
            scaled = self.hook.microspeed_scale_loss(engine=self, loss=loss)
            self.plugins.answered("microspeed_backward",
                                  self.hook.microspeed_backward(engine=self, loss=scaled, retain_graph=retain_graph))
            self.hook.microspeed_after_backward(engine=self, ctx=ctx)
            if ctx.reduce:
                self.plugins.answered("microspeed_reduce_gradients", self.hook.microspeed_reduce_gradients(engine=self))
        gas = self.gradient_accumulation_steps()
        return loss / gas if scale_wrt_gas and gas > 1 else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Count a micro-step; at the accumulation boundary, step the optimizer and scheduler."""
        if self._inside_no_sync:
            raise EngineUsageError("engine.step() inside engine.no_sync(): It is illegal to call Engine.step() inside "
                                   "no_sync context manager; leave the block first, so that gradients are reduced.")
        if self.is_gradient_accumulation_boundary():
            if self.optimizer is None:
                raise ConfigError("engine.step(): no optimizer. Give an 'optimizer' section in the config "
                                  "or initialize(optimizer=...).")
            with self._phase("step"):
                self.hook.microspeed_before_step(engine=self)
                outcome = self.plugins.answered("microspeed_optimizer_step",
                                                self.hook.microspeed_optimizer_step(engine=self))
                if outcome.applied:
                    if self.lr_scheduler is not None:
                        self.lr_scheduler.step(**(lr_kwargs or {}))
                else:
                    self.skipped_steps += 1
                self._last_outcome = outcome
                self.hook.microspeed_after_step(engine=self, outcome=outcome)
                self.zero_grad()
                self.global_steps += 1
                self.global_samples += self.train_batch_size()
                self.micro_steps += 1  # counted before the hook: a save made there is at the window's end
                self.hook.microspeed_after_global_step(engine=self)
                return
        self.micro_steps += 1

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Train on one whole batch: ``gradient_accumulation_steps`` micro-batches, then the step.

        ``data_iter`` yields micro-batches; ``None`` uses :meth:`set_dataiterator`'s iterator or the
        engine's training data loader (repeating). Returns the mean loss (DeepSpeed's ``train_batch``
        contract). Who runs the batch is the hook ``microspeed_train_batch``.
        """
        with self._phase("train_batch"):
            answer = self.hook.microspeed_train_batch(engine=self, data_iter=self._data_iter(data_iter))
            return self.plugins.answered("microspeed_train_batch", answer)

    def eval_batch(self, data_iter: Any, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Evaluate one batch (``num_micro_batches`` or ``gradient_accumulation_steps`` micro-batches).

        Returns the loss (mean over micro-batches with ``reduce_output="avg"``), or ``(loss,
        outputs)`` with ``return_logits``. No gradients, no optimizer step.
        """
        with self._phase("eval_batch"):
            return self.plugins.answered("microspeed_eval_batch", self.hook.microspeed_eval_batch(
                engine=self, data_iter=self._data_iter(data_iter), return_logits=return_logits,
                compute_loss=compute_loss, reduce_output=reduce_output, bcast_loss=bcast_loss,
                num_micro_batches=num_micro_batches))

    def set_dataiterator(self, iterator: Any) -> None:
        """The iterator :meth:`train_batch` draws from when called without one."""
        self._data_iterator = iterator

    def _data_iter(self, data_iter: Any) -> Any:
        if data_iter is not None:
            return data_iter if hasattr(data_iter, "__next__") else iter(data_iter)
        if self._data_iterator is None:
            if self.training_dataloader is None:
                raise ValueError("train_batch()/eval_batch(): no data_iter given and the engine has no training "
                                 "data; pass data_iter=..., call engine.set_dataiterator(...), or "
                                 "initialize(training_data=...).")
            self._data_iterator = iter(RepeatingLoader(self.training_dataloader))
        return self._data_iterator

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's and the optimizer's gradients."""
        if self._params is None or self._params[0] is not self.module:
            self._params = (self.module, list(self.module.parameters()))
        for p in self._params[1]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for backward passes inside the block (as DDP's ``no_sync``); not re-entrant."""
        if self._inside_no_sync:
            raise EngineUsageError("no_sync context manager reentry is unsupported: engine.no_sync() is already "
                                   "active; leave the outer block before entering another.")
        self.hook.microspeed_no_sync(engine=self)
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    @contextlib.contextmanager
    def _phase(self, phase: str) -> Iterator[None]:
        try:
            yield
        except BaseException as exc:
            self.hook.microspeed_on_exception(engine=self, exc=exc, phase=phase)
            raise

    # -- introspection -------------------------------------------------------------------

    def get_lr(self) -> list[float]:
        """The learning rate of each optimizer parameter group."""
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer is not None else []

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm (before clipping) of the last optimizer step."""
        norm = self._last_outcome.grad_norm
        return float(norm) if norm is not None else None

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step was applied (``False`` when a plugin skipped it, e.g. on overflow)."""
        return self._last_outcome.applied

    def train(self, mode: bool = True) -> Engine:
        """Set training mode on the wrapped module."""
        self.module.train(mode)
        self.training = mode
        return self

    def install_api(self, answers: list[dict[str, Any] | None]) -> None:
        """Take the plugins' answers to ``microspeed_engine_api`` (earlier answers win)."""
        for answer in reversed([a for a in answers if a]):
            self._api.update(answer)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        api = self.__dict__.get("_api", {})
        if name in api:
            return api[name]
        module = self._modules.get("module")
        if module is not None and name != "module":
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r} (neither the engine, its "
                             f"plugins nor the wrapped model {type(module).__name__} define it)") from None

    # -- checkpoints (who does it: the built-in ``checkpointing``, see microspeed.checkpoint) ---

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save model, optimizer, scheduler, counters, plugin state and RNG under ``save_dir/tag``.

        Every rank calls it. ``tag`` defaults to ``global_step<N>``; ``save_dir/latest`` names the
        tag once every rank has finished (``save_latest``). Tensors are sharded across ranks through
        ``torch.distributed.checkpoint``; see :mod:`microspeed.checkpoint`. ``exclude_frozen_parameters``
        leaves out parameters with ``requires_grad=False`` (Lightning always passes it).
        """
        return self.plugins.answered("microspeed_save_checkpoint", self.hook.microspeed_save_checkpoint(
            engine=self, save_dir=save_dir, tag=tag, client_state=client_state, save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters))

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, load_rng_state: bool = False,
                        verify: bool = True) -> tuple[str | None, dict]:
        """Load a checkpoint written by :meth:`save_checkpoint` (any world size); return ``(path, client_state)``.

        ``(None, {})`` with a warning when ``load_dir`` has no ``latest`` and no ``tag`` is given. RNG state is left
        alone, as DeepSpeed does, unless ``load_rng_state=True``. ``verify=False``: load one without checksums.
        """
        return self.plugins.answered("microspeed_load_checkpoint", self.hook.microspeed_load_checkpoint(
            engine=self, load_dir=load_dir, tag=tag, load_module_strict=load_module_strict,
            load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only, load_rng_state=load_rng_state, verify=verify))

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Rank 0 writes the module's state dict, in the training dtype, to ``save_dir/save_filename``.

        ``exclude_frozen_parameters`` leaves out parameters with ``requires_grad=False``.
        """
        return self.plugins.answered("microspeed_save_16bit_model", self.hook.microspeed_save_16bit_model(
            engine=self, save_dir=save_dir, save_filename=save_filename,
            exclude_frozen_parameters=exclude_frozen_parameters))
