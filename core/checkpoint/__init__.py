"""Checkpoints: DeepSpeed's layout and API; tensors keyed by name, one contiguous file per rank.

Layout (as DeepSpeed's, one folder per tag, ``latest`` naming the newest)::

    <save_dir>/latest                  the newest complete tag; replaced atomically, last
    <save_dir>/<tag>/manifest.msgpack  run metadata, every small value and a crc32 per tensor item (msgpack)
    <save_dir>/<tag>/.metadata         the index of the tensors (a ``torch.distributed.checkpoint`` Metadata)
    <save_dir>/<tag>/__<rank>_0.distcp the tensors rank <rank> wrote, raw and contiguous
                                       (:mod:`~microspeed.checkpoint.storage`)

Tensors are keyed by parameter name (FQN), never by rank or integer index:

==========================  ======================================================================
``model/<key>``             ``engine.module.state_dict()`` in the training dtype (a tied duplicate
                            is stored once; the manifest lists it as an alias)
``master/<fqn>``            fp32 master weights: optimizer parameters that are not the module's own
                            (fp16/bf16), named through ``microspeed_optimizer_param_names``
``optim/<fqn>/<name>``      optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``, ...)
``lr_scheduler/<path>``     tensors of the scheduler's state (rare)
``plugins/<plugin>/<path>`` tensors of a plugin's checkpoint state
``client/<path>``           tensors of ``client_state`` (rank 0's, as DeepSpeed keeps)
==========================  ======================================================================

The small rest — versions, ds_config, world size, counters, the module's key list, optimizer
param groups (with FQNs), scheduler state, plugin list and each plugin's small state, client
state and every rank's RNG states — is the manifest (:mod:`microspeed.checkpoint.manifest`).
Both halves are read as data, never run: the manifest holds plain values only (a pickle in it is refused,
and so is a state that is not plain data, at save), and the tensor index is read by an unpickler that
admits only DCP's metadata classes (:mod:`~microspeed.checkpoint.tensor_index`).

**Who writes what.** Every rank calls :func:`save` with the same state dict of full tensors;
replicated tensors are written once (:func:`~microspeed.checkpoint.storage.assign`), so in pure data
parallelism the ranks split the writing and each writes only the tensors it was assigned. A plugin
that shards state (ZeRO, tensor parallel) contributes DTensors or rank-unique keys and each shard is written once.

**Composed shardings.** Two plugins may split the same tensor in turn, through two hooks that never
name each other: ``microspeed_checkpoint_placements`` says where this rank's box sits in the full
tensor (tensor parallel), and who writes it (one data-parallel replica; never a ``duplicate`` — a
tied copy on a later pipeline stage, a replicated parameter on tensor rank > 0); a plugin that
splits the box over the data axis (ZeRO's :func:`flat_shard`, in ``microspeed_checkpoint_module_tensors``
and its optimizer parts) presents pieces of that box, which :func:`place_pieces` moves into the full
tensor on save and on load. So a checkpoint written under pp × tp × dp with ZeRO stage 1, 2 or 3
holds every tensor once, whole-shaped, and loads under any other pp, tp, dp and stage, or whole.

**Safety.** Everything goes into ``<tag>.tmp-<nonce>``; each rank writes its file and then its
completion marker; once every rank's is there, rank 0 writes the index and the manifest, renames the
folder to ``<tag>`` and then replaces ``latest`` with ``os.replace``. A save interrupted anywhere (a
rank killed, a writer failing) leaves ``latest`` naming the previous tag. Unreadable, truncated,
foreign or corrupted files (a crc32 mismatch) raise :class:`CheckpointError` naming the file;
checkpoints without checksums (written before checksums existed as DCP's per-tensor files, or stripped) are
refused unless the caller passes ``verify=False`` (``--no-verify`` on ``microspeed checkpoint``). Every path a
file names (``latest``'s tag, the index's file names) must stay inside its folder; re-saving a tag swaps the
folders in one atomic step (:mod:`~microspeed.checkpoint.layout`).

**Asynchronous and periodic saves.** With ``"checkpoint": {"async_save": true}`` a save blocks only
while this rank's tensors are copied into a CPU staging buffer; a thread writes them
(:mod:`~microspeed.checkpoint.background`), and the next save, ``load_checkpoint``,
``engine.wait_for_checkpoint()`` or the end of the process waits for it (a save holding on-demand pieces —
state a plugin keeps in files — is synchronous: they are read as the file is written). ``save_interval_steps`` with
``save_dir`` saves every N steps.

**Other topologies.** Tensors are full and named, so a checkpoint written by N ranks loads on M.
The data loader continues from the same *global* sample count
(:meth:`microspeed.builtin.dataloader.MicroBatchLoader.load_state_dict`). RNG states
are restored only when asked (``load_checkpoint(load_rng_state=True)``; DeepSpeed never restores
them): rank ``r`` restores what rank ``r`` saved when ``r < N``; a rank ``r >= N`` seeds Python, numpy and torch
with a number derived from rank 0's saved torch state and ``r`` (deterministic, distinct per
rank). With another gradient-accumulation count, ``micro_steps`` becomes ``global_steps * GAS``.

**Other precisions.** Loading into an fp32 module prefers ``master/<fqn>`` (exact fp32 weights of
an fp16/bf16 run); fp32 masters of an fp16/bf16 engine come from ``master/<fqn>`` when saved,
else from ``model/<fqn>`` (an fp32 checkpoint), at full precision.

**Modules.** :mod:`~microspeed.checkpoint.layout` (tags, ``latest``, tag folders, manifest and tensor
index, atomic publish), :mod:`~microspeed.checkpoint.storage` (the per-rank files, checksums, resharding
reads), :mod:`~microspeed.checkpoint.background` (the asynchronous writer),
:mod:`~microspeed.checkpoint.sharding` (:func:`flat_shard`, :func:`box_shard`, :class:`Placement`,
:func:`place_pieces`: tensors a rank holds pieces of; :class:`OnDemandPiece`: pieces read only when written,
streamed into the rank's file through a bounded buffer),
:mod:`~microspeed.checkpoint.reader` (:class:`Reader`), :mod:`~microspeed.checkpoint.saving` and
:mod:`~microspeed.checkpoint.loading` (the engine-level entry points and the default optimizer-state
parts), :mod:`~microspeed.checkpoint.names` (FQNs, tied aliases), :mod:`~microspeed.checkpoint.rng`,
:mod:`~microspeed.checkpoint.manifest` (the msgpack half), :mod:`~microspeed.checkpoint.tensor_index` (the
``.metadata`` half, read as data), :mod:`~microspeed.checkpoint.errors`,
:mod:`~microspeed.checkpoint.resume` (``checkpoint.auto_resume_dir``: the newest complete save, loaded at the end
of ``initialize()``);
converters in :mod:`~microspeed.checkpoint.deepspeed_format`, :mod:`~microspeed.checkpoint.export` and
:mod:`~microspeed.checkpoint.zero_to_fp32`. Every public name is importable from here.
"""

from __future__ import annotations

from microspeed.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointTagMismatchError,
    CheckpointWarning,
)
from microspeed.checkpoint.layout import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    new_manifest,
    read_latest,
    read_manifest,
    read_tensor_index,
    resolve_tag_dir,
    write_checkpoint,
)
from microspeed.checkpoint.loading import get_fp32_state_dict, load, load_optimizer_state
from microspeed.checkpoint.manifest import TensorRef
from microspeed.checkpoint.names import optimizer_param_names
from microspeed.checkpoint.reader import Reader, check_verifiable
from microspeed.checkpoint.saving import (
    merge_model_parts,
    merge_optimizer_parts,
    save,
    save_16bit_model,
    save_optimizer_state,
    save_state_dict_file,
)
from microspeed.checkpoint.sharding import (
    OnDemandPiece,
    Placement,
    apply_placements,
    box_shard,
    collect_placements,
    flat_range_boxes,
    flat_shard,
    place_pieces,
    placement_of,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST",
    "MANIFEST",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointTagMismatchError",
    "CheckpointWarning",
    "OnDemandPiece",
    "Placement",
    "Reader",
    "TensorRef",
    "apply_placements",
    "box_shard",
    "check_verifiable",
    "collect_placements",
    "flat_range_boxes",
    "flat_shard",
    "get_fp32_state_dict",
    "load",
    "load_optimizer_state",
    "merge_model_parts",
    "merge_optimizer_parts",
    "new_manifest",
    "optimizer_param_names",
    "place_pieces",
    "placement_of",
    "read_latest",
    "read_manifest",
    "read_tensor_index",
    "resolve_tag_dir",
    "save",
    "save_16bit_model",
    "save_optimizer_state",
    "save_state_dict_file",
    "write_checkpoint",
]
