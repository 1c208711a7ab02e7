"""Distributed test harness: run a function on N local ranks and get back what each rank returned.

This is the harness every multi-rank test of microspeed uses, and the one plugin authors should use
for theirs. Each rank is a fresh process (``multiprocessing``'s "forkserver" context, whose server imported torch
once; "spawn" where there is none or ``MICROSPEED_TEST_START_METHOD=spawn``) with the caller's environment and the usual
launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) and, by default, an initialized ``torch.distributed`` process
group (gloo, CPU), so the body reads like code running under ``torchrun``.

Usage in a plugin's test suite::

    # tests/test_my_plugin.py
    import pytest
    import torch
    import torch.distributed as dist

    from microspeed.testing import distributed, run_distributed


    def _sum_of_ranks(scale):  # module level: spawn imports it by name in every rank
        t = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(t)
        return t.item()


    def test_all_reduce_values():
        assert run_distributed(_sum_of_ranks, world_size=2, args=(10.0,)) == [30.0, 30.0]


    @pytest.mark.parametrize("value", [1.0, 2.5])
    @distributed(world_size=2)  # the whole test body runs on each of the 2 ranks
    def test_all_reduce_in_every_rank(value, tmp_path):  # parameters and fixtures are passed on
        t = torch.tensor([value])
        dist.all_reduce(t)
        assert t.item() == 2 * value


    @pytest.mark.parametrize("world_size", [2, 4])  # vary the world size: call run_distributed
    def test_many_sizes(world_size):
        assert run_distributed(_sum_of_ranks, world_size=world_size, args=(1.0,))[0] == (
            world_size * (world_size + 1) / 2
        )

What you get:

* :func:`run_distributed` returns the list of per-rank return values (index = rank). Return values,
  ``args`` and ``kwargs`` cross process boundaries, so they must be picklable.
* If a rank raises, :class:`DistributedTestError` (an ``AssertionError``, so pytest reports a
  failure) lists every failing rank with its exception and traceback. Ranks left blocked in a
  collective by the failure get a short grace period, then are killed and reported as
  ``rank N: terminated after rank M failed`` together with the Python stack they were stuck in.
* A rank that hangs fails the test after ``timeout`` seconds ("timed out after 120s: rank 1 had not
  finished"), with its stack; it never blocks CI. Children are always reaped, also on Ctrl-C, and
  a rank whose parent process disappears exits on its own.
* ``pytest.skip(...)`` in a rank skips the test (when no rank failed); ``pytest.xfail(...)`` too.
* A rank that dies without reporting (segfault, ``os._exit``) is reported with its exit code.
* Under pytest, ``assert`` statements in the rank bodies are rewritten as in the test process, so
  a failing ``assert a == b`` in a rank shows both values.

Rules for the function a rank runs: it must be defined at module level (spawn finds it again by
module and qualified name; lambdas and nested functions cannot be found), and the module it lives
in is imported afresh in every rank (the ``if __name__ == "__main__":`` guard applies to scripts,
as with any spawn-based multiprocessing). Ranks are started with ``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)`` (several ranks share a few cores); pass ``env={"OMP_NUM_THREADS": "4"}``
to change that. Starting a rank costs a fork and the import of the function's module (the first run of a
session also starts the fork server: about one ``import torch``, seconds on a small machine; with "spawn" every
rank pays that), so prefer one run that checks several things over many tiny runs.

With ``init_process_group=False`` the body starts ``torch.distributed`` itself, for example with
``microspeed.comm.init_distributed()``, which reads the same environment variables; whatever
process group is still initialized when the body returns is destroyed by the harness.

The plugin-author kit (:mod:`microspeed.testing.plugin_kit`) runs a plugin's hooks on a tiny engine:
:func:`tiny_engine` (a small model, a default config, extra plugins), :func:`train_steps` (optimizer
steps, returns the losses), :class:`HookRecorder` (a plugin recording every hook call in order) and
the pytest fixtures ``ms_engine_factory``, ``ms_engine`` and ``hook_recorder`` — use them with
``pytest_plugins = ["microspeed.testing"]`` in a root ``conftest.py``, or import them into any
``conftest.py``. For several processes, call :func:`tiny_engine` inside a module-level rank body
run by :func:`run_distributed`. ``docs/writing-plugins.md`` walks through all of it.

Layout: :mod:`microspeed.testing.harness` holds the distributed harness, :mod:`microspeed.testing.plugin_kit`
the plugin-author kit and :mod:`microspeed.testing.fixtures` its pytest fixtures; this package re-exports
every public name of the three, so ``from microspeed.testing import ...`` and
``pytest_plugins = ["microspeed.testing"]`` work as before. Not re-exported (import them from their modules):
:mod:`microspeed.testing.elastic_job` (an elastic job of two local agents whose second node is killed, for the
node-loss test and the recovery benchmark), :mod:`microspeed.testing.netns` and :mod:`microspeed.testing.sshd`.
"""

from __future__ import annotations

import importlib.util

from microspeed.testing.harness import (
    DEFAULT_GRACE_PERIOD,
    DEFAULT_TIMEOUT,
    DistributedTestError,
    RankFailure,
    distributed,
    free_port,
    in_distributed_worker,
    run_distributed,
)
from microspeed.testing.plugin_kit import (
    TINY_CONFIG,
    HookCall,
    HookRecorder,
    TinyModel,
    tiny_batch,
    tiny_config,
    tiny_engine,
    train_steps,
)

__all__ = [
    "DEFAULT_GRACE_PERIOD",
    "DEFAULT_TIMEOUT",
    "DistributedTestError",
    "RankFailure",
    "distributed",
    "free_port",
    "in_distributed_worker",
    "run_distributed",
    "TINY_CONFIG",
    "HookCall",
    "HookRecorder",
    "TinyModel",
    "tiny_batch",
    "tiny_config",
    "tiny_engine",
    "train_steps",
]

if importlib.util.find_spec("pytest") is not None:  # the fixtures need pytest; the harness and kit do not
    from microspeed.testing.fixtures import hook_recorder, ms_engine, ms_engine_factory  # noqa: F401
