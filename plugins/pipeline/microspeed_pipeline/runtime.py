"""Executing a pipeline schedule on one rank: ``train_batch`` and ``eval_batch``.

The schedule (:mod:`microspeed_pipeline.schedule`) is a list of instructions for this rank; the
runtime gives each kind its meaning, and nothing else decides the order:

* ``LoadMicroBatch``: draw the micro-batch from the data iterator and pass it through the core's
  ``micro_batch`` chain (the first stage keeps its inputs, the last its labels);
* ``ForwardPass``: run this rank's layers of the chunk (between the core's ``before_forward`` and
  ``after_forward`` notifications; keyword arguments a plugin adds to ``ctx.kwargs`` go to the layers
  whose forward names them); the last virtual stage computes the loss;
* before each ``ForwardPass``/``BackwardPass`` the core's ``next_pass`` notification names it and the next
  compute pass of this rank's schedule (ZeRO-3 prefetches and keeps parameters across the two; a
  gradient reducer reduces only the chunk whose backward ends);
* ``BackwardPass``: between ``before_backward`` and ``after_backward``, the last virtual stage
  scales the loss through the core's ``scale_loss`` chain (gradient accumulation, fp16 loss
  scale) and runs the core's ``backward``; the others back-propagate the gradient they received;
* ``Send*``/``Recv*``: :class:`~microspeed_pipeline.p2p.P2P`;
* ``ReduceTiedGrads``: sum tied weights' gradients across their stages — unless the owner of gradient
  reduction states ``GradientPartitioning.sums_marked_gradients``: it then sums the tied copies
  (marked :class:`~microspeed.plugin_api.GradientSum`) after its own reduction;
* ``ReduceGrads``: the core's ``reduce_gradients`` (data parallel, or ZeRO, over the data axis).
  Backward passes run with ``StepContext(boundary=False, reduce=False)``: the accumulation window ends
  at ``ReduceGrads``; an owner that partitions gradients during backward (ZeRO-2/3) reduce-scatters
  each micro-batch's gradients into its partitions as it does for any accumulation step;
* ``OptimizerStep``: the core's ``engine.step()`` at the accumulation boundary.

The batch's loss is the mean over micro-batches on the last stage, averaged over the data-parallel
group and broadcast to every stage of the pipeline, as DeepSpeed reports it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from microspeed.plugin_api import GradientPartitioning, StepContext
from microspeed_pipeline import schedule as sched
from microspeed_pipeline.module import PipelineModule, TiedLayerSpec
from microspeed_pipeline.p2p import P2P, as_tuple


class PipelineRuntime:
    """Runs schedules for one engine whose module is a :class:`PipelineModule`."""

    def __init__(self, engine: Any, module: PipelineModule, schedule: str | None = None) -> None:
        self.engine = engine
        self.module = module
        self.grid = module.mpu()
        self.stages = module.num_stages
        self.stage_id = module.stage_id
        self.chunks = module.num_chunks
        self.schedule_name = schedule
        self.p2p = P2P(engine.device, dynamic_shape=getattr(module, "dynamic_shape", False))
        self.timings: dict[str, float] = {}
        self.running = False
        self._proven: set[tuple[int, int]] = set()
        part = engine.capabilities.get(GradientPartitioning)
        self._owner_sums_ties = part is not None and part.sums_marked_gradients
        self._reset()

    def _reset(self) -> None:
        self.batches: dict[int, Any] = {}
        self.inputs: dict[tuple[int, int], Any] = {}
        self.outputs: dict[tuple[int, int], Any] = {}
        self.grads: dict[tuple[int, int], Any] = {}
        self.input_grads: dict[tuple[int, int], Any] = {}
        self.losses: list[torch.Tensor] = []
        self.logits: list[Any] = []

    # -- schedules ---------------------------------------------------------------------

    def train_schedule(self, micro_batches: int) -> sched.PipeSchedule:
        """The training schedule this runtime runs for ``micro_batches``."""
        name = self.schedule_name
        if name is None:
            name = "interleaved" if self.chunks > 1 else "1f1b"
        if name == "interleaved":
            if micro_batches % self.stages and (micro_batches, self.chunks) not in self._proven:
                # a short last group: prove this configuration on every stage once (well under a second)
                sched.simulate([sched.InterleavedTrainSchedule(micro_batches, self.stages, s, self.chunks)
                                for s in range(self.stages)])
                self._proven.add((micro_batches, self.chunks))
            return sched.InterleavedTrainSchedule(micro_batches, self.stages, self.stage_id, self.chunks)
        if self.chunks > 1:
            raise ValueError(f"pipeline.schedule={name!r} runs one chunk per stage, but the PipelineModule has "
                             f"num_chunks={self.chunks}; use 'interleaved' (or leave pipeline.schedule unset).")
        if name == "gpipe":
            return sched.GPipeSchedule(micro_batches, self.stages, self.stage_id)
        return sched.TrainSchedule(micro_batches, self.stages, self.stage_id)

    def chunk_parameters(self) -> list[list[torch.nn.Parameter]]:
        """This rank's parameters by chunk (a tied module's in each chunk that runs it), for the core's
        ``pass_parameters`` question."""
        out = []
        for chunk in range(self.chunks):
            seen: dict[int, torch.nn.Parameter] = {}
            for _idx, f in self.module._funcs[chunk]:
                layer = self.module.tied_modules[f.key] if isinstance(f, TiedLayerSpec) else f
                if isinstance(layer, torch.nn.Module):
                    seen.update((id(p), p) for p in layer.parameters())
            out.append(list(seen.values()))
        return out

    # -- helpers -----------------------------------------------------------------------

    def _is_first_virtual(self, chunk: int) -> bool:
        return self.stage_id == 0 and chunk == 0

    def _is_last_virtual(self, chunk: int) -> bool:
        return self.stage_id == self.stages - 1 and chunk == self.chunks - 1

    def _peer_rank(self, stage: int) -> int:
        return self.grid.stage_to_global(stage)

    def _load(self, mb: int) -> None:
        if mb not in self.batches:
            try:
                batch = next(self.data_iter)
            except StopIteration:
                raise RuntimeError(f"pipeline: the data iterator ran out at micro-batch {mb + 1}; pass a longer (or "
                                   f"repeating: microspeed.RepeatingLoader) iterator.") from None
            # every stage loads every micro-batch: a plugin that changes it (curriculum) does so alike on all
            self.batches[mb] = self.engine.hook.microspeed_micro_batch(engine=self.engine, batch=batch, index=mb)

    def _split(self, batch: Any) -> tuple[Any, Any]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            return batch[0], batch[1]
        raise TypeError(f"pipeline: each micro-batch must be an (inputs, labels) pair, got {type(batch).__name__}"
                        f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}.")

    # -- instructions ------------------------------------------------------------------

    def _forward(self, mb: int, chunk: int) -> None:
        if self._is_first_virtual(chunk):
            inputs, _ = self._split(self.batches[mb])
            if isinstance(inputs, torch.Tensor):
                inputs = inputs.to(self.engine.device)
            x = inputs
        else:
            # a received activation that needs a gradient is a leaf: clone it (as DeepSpeed does) so a first
            # layer that works in place (ReLU(inplace=True)) may write into it; its .grad still comes back
            received = tuple(t.clone() if t.requires_grad else t for t in self.inputs[(chunk, mb)])
            x = received if len(received) > 1 else received[0]
        engine = self.engine
        engine.ctx = ctx = StepContext(args=(x,), boundary=True)
        engine.hook.microspeed_before_forward(engine=engine, ctx=ctx)
        ctx.outputs = self.module(*ctx.args, chunk=chunk, **ctx.kwargs)  # keywords reach the layers naming them
        engine.hook.microspeed_after_forward(engine=engine, ctx=ctx)
        out = ctx.outputs
        if self._is_last_virtual(chunk):
            _, labels = self._split(self.batches[mb])
            if isinstance(labels, torch.Tensor):
                labels = labels.to(self.engine.device)
            if self.compute_loss:
                loss = self.module.loss_fn(out, labels) if self.module.loss_fn is not None else out
                if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                    raise TypeError("pipeline: the last stage must produce a scalar loss (give PipelineModule a "
                                    "loss_fn(outputs, labels)).")
                self.losses.append(loss)
            if self.return_logits:
                self.logits.append(out.detach() if isinstance(out, torch.Tensor) else out)
            self.outputs[(chunk, mb)] = self.losses[-1] if self.compute_loss else None
        else:
            self.outputs[(chunk, mb)] = as_tuple(out)

    def _backward(self, mb: int, chunk: int) -> None:
        engine = self.engine
        # the window ends at ReduceGrads: the built-in and ZeRO-1 reduce there; ZeRO-2/3 reduce-scatter each
        # micro-batch's gradients into their partitions as for any micro-step inside an accumulation window
        engine.ctx = ctx = StepContext(boundary=False, reduce=False)
        if self._is_last_virtual(chunk):
            ctx.loss = loss = self.outputs.pop((chunk, mb))
            engine.hook.microspeed_before_backward(engine=engine, ctx=ctx)
            scaled = engine.hook.microspeed_scale_loss(engine=engine, loss=loss)
            engine.hook.microspeed_backward(engine=engine, loss=scaled, retain_graph=False)
        else:
            outs = self.outputs.pop((chunk, mb))
            grads = self.grads.pop((chunk, mb))
            pairs = [(o, g) for o, g in zip((o for o in outs if o.requires_grad), grads, strict=True)]
            engine.hook.microspeed_before_backward(engine=engine, ctx=ctx)
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        engine.hook.microspeed_after_backward(engine=engine, ctx=ctx)
        if not self._is_first_virtual(chunk):
            received = self.inputs.pop((chunk, mb))
            self.input_grads[(chunk, mb)] = tuple(
                (t.grad if t.grad is not None else torch.zeros_like(t)) for t in received if t.requires_grad)
        else:
            self.inputs.pop((chunk, mb), None)

    def _send_activation(self, ins: Any) -> None:
        outs = self.outputs[(ins.chunk, ins.micro_batch)]
        self.p2p.send(outs, self._peer_rank(ins.peer), "act", ins.peer_chunk, ins.micro_batch)
        if not torch.is_grad_enabled():  # inference: nothing comes back for it
            self.outputs.pop((ins.chunk, ins.micro_batch))

    def _recv_activation(self, ins: Any) -> None:
        self.inputs[(ins.chunk, ins.micro_batch)] = self.p2p.recv(self._peer_rank(ins.peer), "act", ins.chunk,
                                                                  ins.micro_batch)
        if not torch.is_grad_enabled():
            self.inputs[(ins.chunk, ins.micro_batch)] = tuple(t.detach() for t in self.inputs[(ins.chunk,
                                                                                                 ins.micro_batch)])

    def _send_grad(self, ins: Any) -> None:
        grads = self.input_grads.pop((ins.chunk, ins.micro_batch))
        if grads:
            self.p2p.send(grads, self._peer_rank(ins.peer), "grad", ins.peer_chunk, ins.micro_batch)

    def _recv_grad(self, ins: Any) -> None:
        outs = self.outputs[(ins.chunk, ins.micro_batch)]
        if any(o.requires_grad for o in outs):
            self.grads[(ins.chunk, ins.micro_batch)] = self.p2p.recv(self._peer_rank(ins.peer), "grad", ins.chunk,
                                                                     ins.micro_batch)
        else:
            self.grads[(ins.chunk, ins.micro_batch)] = ()

    def _execute(self, schedule: sched.PipeSchedule) -> None:
        self.p2p.new_batch()
        self.running = True
        try:
            self._run(schedule)
        finally:
            self.running = False

    def _run(self, schedule: sched.PipeSchedule) -> None:
        busy = 0.0
        instructions = schedule.instructions()
        passes = [("forward" if isinstance(ins, sched.ForwardPass) else "backward", ins.chunk) for ins in instructions
                  if isinstance(ins, (sched.ForwardPass, sched.BackwardPass))]
        done = 0
        for ins in instructions:
            if isinstance(ins, sched.LoadMicroBatch):
                self._load(ins.micro_batch)
            elif isinstance(ins, (sched.ForwardPass, sched.BackwardPass)):
                # say which pass starts and which follows (ZeRO-3 prefetches across, reducers reduce one chunk)
                done += 1
                self.engine.hook.microspeed_next_pass(engine=self.engine, current=passes[done - 1],
                                                      upcoming=passes[done] if done < len(passes) else None)
                t0 = time.perf_counter()
                if isinstance(ins, sched.ForwardPass):
                    self._forward(ins.micro_batch, ins.chunk)
                else:
                    self._backward(ins.micro_batch, ins.chunk)
                busy += time.perf_counter() - t0
            elif isinstance(ins, sched.SendActivation):
                self._send_activation(ins)
            elif isinstance(ins, sched.RecvActivation):
                self._recv_activation(ins)
            elif isinstance(ins, sched.SendGrad):
                self._send_grad(ins)
            elif isinstance(ins, sched.RecvGrad):
                self._recv_grad(ins)
            elif isinstance(ins, sched.ReduceTiedGrads):
                self.p2p.wait_all()
                if not self._owner_sums_ties:
                    self.module.allreduce_tied_weight_gradients()
            elif isinstance(ins, sched.ReduceGrads):
                self.engine.ctx = StepContext(boundary=True, reduce=True)
                self.engine.hook.microspeed_reduce_gradients(engine=self.engine)
            elif isinstance(ins, sched.OptimizerStep):
                self._step()
            else:
                raise TypeError(f"pipeline: no handler for instruction {ins!r}.")
        self.p2p.wait_all()
        self.timings["compute"] = busy

    def _step(self) -> None:
        engine = self.engine
        gas = engine.gradient_accumulation_steps()
        engine.micro_steps += gas - 1  # the schedule ran gas micro-steps; step() counts the last
        engine.step()

    # -- the batch's loss --------------------------------------------------------------

    def _aggregate(self, losses: list[torch.Tensor], reduce_output: str | None, bcast: bool) -> Any:
        last = self.grid.stage_to_global(self.stages - 1)
        if reduce_output is None:
            return [loss.detach() for loss in losses] if self.module.is_last_stage() else None
        if self.module.is_last_stage():
            agg = torch.stack([loss.detach().float() for loss in losses]).mean()
            if self.grid.get_data_parallel_world_size() > 1:
                dist.all_reduce(agg, group=self.grid.get_data_parallel_group())
                agg /= self.grid.get_data_parallel_world_size()
        else:
            agg = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        if bcast and self.stages > 1:
            dist.broadcast(agg, src=last, group=self.grid.get_pipe_parallel_group())
        return agg

    # -- entry points --------------------------------------------------------------------

    def train_batch(self, data_iter: Any) -> torch.Tensor:
        """Run the training schedule over ``gradient_accumulation_steps`` micro-batches; the mean loss."""
        self.data_iter = data_iter
        self.compute_loss, self.return_logits = True, False
        self.module.train()
        self._reset()
        t0 = time.perf_counter()
        self._execute(self.train_schedule(self.engine.gradient_accumulation_steps()))
        self.timings["batch"] = time.perf_counter() - t0
        loss = self._aggregate(self.losses, "avg", True)
        self._reset()
        return loss

    def eval_batch(self, data_iter: Any, return_logits: bool, compute_loss: bool, reduce_output: str | None,
                   bcast_loss: bool, num_micro_batches: int | None) -> Any:
        """Run the inference schedule; the loss (and the last stage's outputs with ``return_logits``)."""
        self.data_iter = data_iter
        self.compute_loss, self.return_logits = compute_loss, return_logits
        micro = num_micro_batches or self.engine.gradient_accumulation_steps()
        was_training = self.module.training
        self.module.eval()
        self._reset()
        try:
            with torch.no_grad():
                self._execute(sched.InferenceSchedule(micro, self.stages, self.stage_id, self.chunks))
            loss = self._aggregate(self.losses, reduce_output, bcast_loss) if compute_loss else None
            logits = self.logits
        finally:
            self.module.train(was_training)
            self._reset()
        return (loss, logits) if return_logits else loss
