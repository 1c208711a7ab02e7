"""An elastic job of two local "nodes" whose second one dies: shared by the node-loss test and the recovery benchmark.

Two torchrun agents on this machine (``microspeed run --elastic 1:2``, one rank each) meet on one c10d rendezvous
and train an MLP under ZeRO-2, saving every ``save_interval`` steps with ``checkpoint.auto_resume_dir``. Killing the
second agent and its rank (:meth:`ElasticJob.kill_node`, SIGKILL: a node lost) makes the first one's rank fail in its
next collective; its agent restarts it at world size 1 and ``initialize()`` resumes from the last complete save with
the global batch kept (4 micro-batches on one rank instead of 2 on each of two)::

    from microspeed.testing.elastic_job import ElasticJob, JobSpec

    spec = JobSpec(steps=8)
    with ElasticJob(tmp_path, spec) as job:
        job.start()
        job.wait_until(lambda: job.completed(attempt=0, rank=1) >= 3)  # a step after the first save, on both
        job.kill_node(rank=1)
        log = job.wait()                           # the survivor's agent output; it finished the run
    after = job.records(attempt=1, rank=0)         # the survivor's steps after the restart

Each rank writes ``attempt<N>_rank<R>.jsonl`` into the job's ``out`` folder (``N`` is torchelastic's restart count):
one JSON object per line with an ``event``: ``started`` (``t``: the script's first line, before ``import torch``;
``pid``), ``initialized`` (``t0``/``t1``: around ``microspeed.initialize()``, which includes the automatic resume;
``world``, ``start`` the first step to run, ``resumed_from``), ``step`` (``step``, ``losses`` of this rank's
micro-batches, ``world``, ``start``, ``resumed_from``, ``batch`` the global batch, ``t`` when the step ended) and
``failed`` (``t``, ``error``: the exception that ended the rank, re-raised). Times are ``time.time()``.
:func:`reference_losses` replays the same steps on one process loaded by hand from a tag, to compare against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from microspeed.testing.harness import free_port

MICRO_BATCHES = 4
"""Micro-batches per global batch: 2 per rank at world size 2, 4 (accumulated) at world size 1."""

SCRIPT = """\
import time
STARTED = time.time()  # before importing torch: the worker process's start
import sys
from microspeed.testing.elastic_job import train
train(sys.argv[1:], started=STARTED)
"""
"""The training script the agents launch (:func:`write_script`): it records its start time and calls :func:`train`."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What the job trains: an MLP ``inputs -> hidden (x layers) -> 1``, Adam, ZeRO-2, ``steps`` optimizer steps of
    ``MICRO_BATCHES * micro_rows`` rows, a save every ``save_interval`` steps, ``pause`` seconds between steps
    (so a kill can land between them)."""

    inputs: int = 8
    hidden: int = 16
    layers: int = 1
    micro_rows: int = 2
    steps: int = 8
    save_interval: int = 2
    lr: float = 0.01
    pause: float = 0.5
    threads: int = 1

    def to_json(self) -> str:
        """The spec as one JSON string (the script's third argument)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """The spec :meth:`to_json` wrote."""
        return cls(**json.loads(text))

    @property
    def batch(self) -> int:
        """Rows per optimizer step (the global batch, kept at every world size)."""
        return MICRO_BATCHES * self.micro_rows


def make_model(spec: JobSpec) -> Any:
    """The spec's MLP, seeded (``torch.manual_seed(0)``): the same weights in every process."""
    import torch

    torch.manual_seed(0)
    layers, width = [], spec.inputs
    for _ in range(spec.layers):
        layers += [torch.nn.Linear(width, spec.hidden), torch.nn.ReLU()]
        width = spec.hidden
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def config(spec: JobSpec, ckpt: str | None = None) -> dict[str, Any]:
    """The engine config: ZeRO-2, Adam; with ``ckpt``, periodic saves into it and automatic resume from it."""
    cfg: dict[str, Any] = {
        "train_batch_size": spec.batch, "train_micro_batch_size_per_gpu": spec.micro_rows, "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": spec.lr}}, "zero_optimization": {"stage": 2}}
    if ckpt is not None:
        cfg["checkpoint"] = {"save_dir": ckpt, "save_interval_steps": spec.save_interval, "auto_resume_dir": ckpt}
    return cfg


def run_step(engine: Any, spec: JobSpec, step: int, rank: int = 0, world: int = 1) -> list[float]:
    """One optimizer step on this rank's micro-batches of step ``step``'s global batch (seeded by the step); their
    losses."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(spec.batch, spec.inputs, generator=g), torch.randn(spec.batch, 1, generator=g)
    losses = []
    for micro in range(rank, MICRO_BATCHES, world):
        rows = slice(micro * spec.micro_rows, (micro + 1) * spec.micro_rows)
        loss = torch.nn.functional.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def train(argv: list[str], started: float | None = None) -> None:
    """The training script's body: ``OUT CKPT SPEC_JSON``; writes this rank's records into ``OUT``."""
    import torch
    import torch.distributed as dist

    import microspeed

    out, ckpt, spec = argv[0], argv[1], JobSpec.from_json(argv[2])
    torch.set_num_threads(spec.threads)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank_env = os.environ.get("RANK", "0")
    with open(os.path.join(out, f"attempt{attempt}_rank{rank_env}.jsonl"), "a") as log:
        def write(event: str, **fields: Any) -> None:
            log.write(json.dumps({"event": event, **fields}) + "\n")
            log.flush()

        write("started", t=started if started is not None else time.time(), pid=os.getpid())
        try:
            t0 = time.time()
            engine = microspeed.initialize(model=make_model(spec), config=config(spec, ckpt))[0]
            rank, world, start = dist.get_rank(), dist.get_world_size(), engine.global_steps
            write("initialized", t0=t0, t1=time.time(), world=world, start=start, resumed_from=engine.resumed_from)
            while engine.global_steps < spec.steps:
                step = engine.global_steps
                losses = run_step(engine, spec, step, rank, world)
                write("step", step=step, losses=losses, world=world, start=start, resumed_from=engine.resumed_from,
                      batch=engine.train_batch_size(), t=time.time())
                time.sleep(spec.pause)
        except BaseException as exc:
            write("failed", t=time.time(), error=f"{type(exc).__name__}: {exc}"[:500])
            raise


def reference_losses(spec: JobSpec, ckpt: str, tag: str, first: int) -> list[list[float]]:
    """One process, ZeRO-2, loaded by hand (``load_checkpoint(ckpt, tag)``): the losses of steps
    ``first .. spec.steps - 1`` (one list per step)."""
    import microspeed

    engine = microspeed.initialize(model=make_model(spec), config=config(spec))[0]
    engine.load_checkpoint(ckpt, tag=tag)
    return [run_step(engine, spec, step) for step in range(first, spec.steps)]


def write_script(folder: str | os.PathLike[str]) -> Path:
    """Write :data:`SCRIPT` as ``train.py`` into ``folder``; its path."""
    path = Path(folder) / "train.py"
    path.write_text(SCRIPT)
    return path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from ``/proc`` (torchrun starts its ranks in their own sessions: a process
    group kill misses them)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(pid: int) -> None:
    """SIGKILL every process below ``pid`` (found first), then ``pid``."""
    for p in [*descendants(pid), pid]:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def read_records(folder: str | os.PathLike[str], attempt: int, rank: int, event: str | None = "step") -> list[dict]:
    """The records rank ``rank`` wrote in restart ``attempt`` (only those of ``event``; ``None``: all); ``[]`` when
    it wrote none. A line still being written (no newline yet) is left out."""
    path = Path(folder) / f"attempt{attempt}_rank{rank}.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]
    return [r for r in map(json.loads, lines) if event is None or r["event"] == event]


class ElasticJob:
    """Two local agents of ``microspeed run --elastic 1:2`` (one rank each) training :class:`JobSpec` in ``folder``
    (``train.py``, ``out/`` for the records, ``ckpt/``, ``logs/``). Leaving the ``with`` block SIGKILLs whatever is
    still running. ``rdzv_conf`` is torchrun's ``--rdzv-conf``; ``max_restarts`` its ``--max-restarts``."""

    def __init__(self, folder: str | os.PathLike[str], spec: JobSpec, max_restarts: int = 2,
                 rdzv_conf: str = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3") -> None:
        self.folder, self.spec = Path(folder), spec
        self.out, self.ckpt = self.folder / "out", self.folder / "ckpt"
        self.port = free_port()
        self.argv = [sys.executable, "-m", "microspeed.cli", "run", "--elastic", "1:2", "--max_restarts",
                     str(max_restarts), "--master-port", str(self.port), "--rdzv-conf", rdzv_conf,
                     "--log-dir", str(self.folder / "logs"), "train.py", str(self.out), str(self.ckpt), spec.to_json()]
        self.env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads), "MICROSPEED_JOB_ID": f"elastic-{self.port}"}
        self.max_restarts = max_restarts
        self.agents: list[subprocess.Popen[str]] = []
        self._logs: dict[int, str] = {}

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, *exc: object) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
                agent.wait()

    def _agent(self) -> subprocess.Popen[str]:
        agent = subprocess.Popen(self.argv, cwd=self.folder, env=self.env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.agents.append(agent)
        return agent

    def start(self, timeout: float = 120.0) -> None:
        """Start both agents: the first hosts the rendezvous store, the second joins it once it listens."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(exist_ok=True)
        write_script(self.folder)
        first = self._agent()
        deadline = time.monotonic() + timeout
        while not listening(self.port) and first.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the first agent did not listen on port {self.port} within {timeout:.0f} s")
            time.sleep(0.05)
        self._agent()

    def _log(self, agent: subprocess.Popen[str], timeout: float) -> str:
        if agent.pid not in self._logs:
            self._logs[agent.pid] = agent.communicate(timeout=timeout)[0]
        return self._logs[agent.pid]

    def output(self, timeout: float = 5.0) -> list[str]:
        """The last 3000 characters of each finished agent's output (for failure messages)."""
        return [self._log(a, timeout)[-3000:] if a.poll() is not None else "(running)" for a in self.agents]

    def wait_until(self, ready: Callable[[], bool], timeout: float = 120.0, poll: float = 0.05) -> None:
        """Poll ``ready()`` until it is true; raise (with the agents' output) when an agent exits first or
        ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not ready():
            if any(a.poll() is not None for a in self.agents):
                raise AssertionError(f"an agent exited early: {self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready within {timeout:.0f} s")
            time.sleep(poll)

    def records(self, attempt: int, rank: int, event: str | None = "step") -> list[dict]:
        """:func:`read_records` of this job's ``out`` folder."""
        return read_records(self.out, attempt, rank, event)

    def completed(self, attempt: int, rank: int) -> int:
        """The last step rank ``rank`` completed in ``attempt`` (-1 before the first)."""
        return max((r["step"] for r in self.records(attempt, rank)), default=-1)

    def agent_of(self, rank: int, attempt: int = 0) -> subprocess.Popen[str]:
        """The agent whose worker is rank ``rank`` of ``attempt`` (found by the worker's pid)."""
        started = self.records(attempt, rank, "started")
        if not started:
            raise LookupError(f"rank {rank} of attempt {attempt} has not started")
        for agent in self.agents:
            if started[0]["pid"] in descendants(agent.pid):
                return agent
        raise LookupError(f"no running agent has rank {rank} of attempt {attempt} (pid {started[0]['pid']})")

    def kill_node(self, rank: int = 1) -> tuple[float, subprocess.Popen[str]]:
        """SIGKILL the agent running rank ``rank`` (attempt 0) and all its processes: a node lost. Returns the
        ``time.time()`` of the kill and the surviving agent."""
        doomed = self.agent_of(rank)
        killed_at = time.time()
        kill_tree(doomed.pid)
        doomed.wait()
        return killed_at, next(a for a in self.agents if a is not doomed)

    def wait(self, agent: subprocess.Popen[str] | None = None, timeout: float = 300.0) -> str:
        """Wait for ``agent`` (default: the first still running) to exit; its output. Raises when it failed."""
        agent = agent or next(a for a in self.agents if a.poll() is None)
        log = self._log(agent, timeout)
        if agent.returncode != 0:
            raise AssertionError(f"the agent exited with {agent.returncode}: {log[-4000:]}")
        return log

    def resumed(self, event: str | None = "step") -> Iterator[dict]:
        """The records of rank 0 in the restarts after the first attempt (the survivor's), in order."""
        for attempt in range(1, self.max_restarts + 1):
            yield from self.records(attempt, 0, event)
