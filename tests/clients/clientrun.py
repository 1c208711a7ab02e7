"""Launch the client scripts of this folder under real DeepSpeed (to record) or microspeed's stand-in (to test).

Shared by the tests (``test_*.py``) and by ``record.py``, which regenerates the reference figures in
``fixtures/`` from real DeepSpeed 0.19.8 (``python tests/clients/record.py``; needs real DeepSpeed installed,
``DS_ACCELERATOR=cpu`` is set here).

``impl="microspeed"`` puts the stand-in folder (``compat/deepspeed/src``) first on ``PYTHONPATH`` — the recipe
``microspeed deepspeed-path`` prints — so ``import deepspeed`` in every launched process gets microspeed;
``impl="deepspeed"`` leaves it off so the installed real DeepSpeed is imported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURES = HERE / "fixtures"
STANDIN = REPO / "compat" / "deepspeed" / "src"
EXAMPLES_GIT = Path("/work/.mirror/deepspeedai+DeepSpeedExamples/repo")

#: Tolerance for fp32 figures (loss, grad norm, weights' norm) against real DeepSpeed's: the same seed, data
#: and order of operations; only the reduction order of collectives may differ, so a relative 1e-4.
RTOL = 1e-4
ATOL = 1e-6


class ClientRunError(AssertionError):
    """A launched client run exited non-zero; carries the tail of its output."""


def needs(module: str):
    """A skip mark for when ``module`` (a client library, from the test extras) is not installed."""
    import importlib.util

    import pytest

    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"{module} is not installed")


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_env(impl: str, extra: dict | None = None) -> dict:
    """Environment for a launched client: which ``deepspeed`` it imports, one thread per rank, CPU accelerator."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != STANDIN]
    if impl == "microspeed":
        paths.insert(0, str(STANDIN))
    elif impl != "deepspeed":
        raise ValueError(f"impl must be 'microspeed' or 'deepspeed', not {impl!r}")
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    env.update(extra or {})
    return env


def torchrun(script: Path | str, args: list[str], impl: str, nproc: int = 2, timeout: float = 300,
             env: dict | None = None, cwd: Path | str | None = None) -> str:
    """Run ``script`` under ``python -m torch.distributed.run`` on ``nproc`` local ranks; returns its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(script), *args]
    return _run(cmd, client_env(impl, env), timeout, cwd)


def accelerate_launch(script: Path | str, args: list[str], impl: str, nproc: int = 2, timeout: float = 300) -> str:
    """Run ``script`` with ``accelerate launch --use_deepspeed`` on ``nproc`` local processes."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(nproc), "--num_machines", "1",
           "--main_process_port", str(free_port()), "--use_deepspeed", "--mixed_precision", "no",
           "--dynamo_backend", "no", str(script), *args]
    return _run(cmd, client_env(impl), timeout, None)


def _run(cmd: list[str], env: dict, timeout: float, cwd) -> str:
    """Run ``cmd`` in its own session; on timeout the whole session (launcher and ranks) is killed."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise ClientRunError(f"timed out after {timeout}s: {' '.join(cmd)}\n{_errors(out)}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise ClientRunError(f"exit {proc.returncode}: {' '.join(cmd)}\n{_errors(out)}")
    return out


def _errors(out: str) -> str:
    """The lines that say what went wrong (a rank's exception), then the tail."""
    lines = out.splitlines()
    key = [ln for ln in lines if "Error" in ln and "elastic" not in ln][:8]
    return "\n".join(["first error lines:", *key, "--- tail ---", *lines[-60:]])


def error_lines(out: str) -> list[str]:
    """The distinct exception lines of a failed run's output (``ValueError: ...``), rank prefixes removed."""
    seen: list[str] = []
    for ln in out.splitlines():
        ln = ln.split("]: ", 1)[1] if ln.startswith("[rank") and "]: " in ln else ln
        if ("Error:" in ln or "Exception:" in ln) and "ChildFailedError" not in ln and ln.strip() not in seen:
            seen.append(ln.strip())
    return seen


def load_fixture(name: str) -> dict:
    """A recorded reference (``fixtures/<name>.json``)."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


def save_fixture(name: str, data: dict) -> None:
    """Write a recorded reference (``fixtures/<name>.json``)."""
    FIXTURES.mkdir(exist_ok=True)
    (FIXTURES / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def imported_deepspeed() -> dict:
    """Which ``deepspeed`` this process imported, and every loaded module that is real DeepSpeed's own file.

    Called at the end of a client run (it imports ``deepspeed``); a run through the stand-in must show none of
    real DeepSpeed's modules (a module file under a ``site-packages/deepspeed/`` folder).
    """
    import deepspeed

    real = sorted(name for name, mod in list(sys.modules.items())
                  if "site-packages/deepspeed/" in (getattr(mod, "__file__", None) or "").replace(os.sep, "/"))
    return {"deepspeed": deepspeed.__file__, "deepspeed_version": deepspeed.__version__, "real_deepspeed_modules": real}


def assert_microspeed_imported(result: dict) -> None:
    """The run's ``deepspeed`` was microspeed's stand-in, not real DeepSpeed, and no module of real DeepSpeed
    was loaded."""
    assert str(STANDIN) in result["deepspeed"], f"the run imported {result['deepspeed']}, not the stand-in"
    assert "microspeed" in result["deepspeed_version"], result["deepspeed_version"]
    assert result.get("real_deepspeed_modules", None) == [], (
        f"real DeepSpeed modules loaded: {result.get('real_deepspeed_modules')}")


def close(actual, expected, what: str, rtol: float = RTOL, atol: float = ATOL) -> None:
    """Assert two figures, or two equal-length lists / dicts of figures, agree within the tolerance."""
    if isinstance(expected, dict):
        assert sorted(actual, key=str) == sorted(expected, key=str), (
            f"{what}: keys {sorted(actual)} != {sorted(expected)}")
        for k in expected:
            close(actual[k], expected[k], f"{what}[{k}]", rtol, atol)
        return
    if isinstance(expected, list):
        assert len(actual) == len(expected), f"{what}: {len(actual)} values != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            close(a, e, f"{what}[{i}]", rtol, atol)
        return
    assert abs(actual - expected) <= atol + rtol * abs(expected), f"{what}: microspeed {actual} != DeepSpeed {expected}"


def _read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def hf_resumed_only(full: dict, resumed: dict, save_steps: int) -> dict:
    """The figures of a resumed HF run that it computed itself (steps after the checkpoint).

    The resumed Trainer's ``log_history`` starts with the checkpoint's own (steps up to ``save_steps``), which
    would compare equal whatever the resume did, so those are dropped.
    """
    del full
    return {k: {s: v for s, v in resumed[k].items() if int(s) > save_steps} for k in ("loss", "grad_norm")} | {
        k: resumed[k] for k in ("deepspeed", "deepspeed_version", "real_deepspeed_modules", "bf16_enabled",
                                "param_dtype") if k in resumed}


def run_hf_trainer(stage: int, impl: str, workdir: Path, client_optimizer: bool = False,
                   offload: bool = False, bf16: bool = False) -> dict:
    """HF Trainer, ZeRO ``stage``, 2 ranks: 6 steps saving at 3, then resumed from step 3 to 6."""
    out = Path(workdir) / f"hf{stage}{'_offload' if offload else ''}{'_bf16' if bf16 else ''}"
    common = ["--stage", str(stage), "--out-dir", str(out), "--max-steps", "6", "--save-steps", "3"]
    if client_optimizer:
        common.append("--client-optimizer")
    if offload:
        common.append("--offload")
    if bf16:
        common.append("--bf16")
    torchrun(HERE / "hf_trainer_run.py", [*common, "--phase", "full", "--json", str(out) + "_full.json"], impl)
    torchrun(HERE / "hf_trainer_run.py", [*common, "--phase", "resume", "--json", str(out) + "_resume.json"], impl)
    full = _read(str(out) + "_full.json")
    return {"full": full, "resume": hf_resumed_only(full, _read(str(out) + "_resume.json"), 3)}


def run_accelerate(stage: int, impl: str, workdir: Path) -> dict:
    """Accelerate + DeepSpeedPlugin, ZeRO ``stage``, ``accelerate launch`` 2 processes, accumulation 2."""
    js = Path(workdir) / f"acc{stage}.json"
    accelerate_launch(HERE / "accelerate_run.py", ["--stage", str(stage), "--json", str(js)], impl)
    return _read(js)


def run_accelerate_resume(stage: int, impl: str, workdir: Path) -> dict:
    """As :func:`run_accelerate` with ``save_state`` after 6 micro-steps, then a second launch that
    ``load_state``s there and runs micro-steps 7-12: ``{"full": ..., "resume": ...}``."""
    state = Path(workdir) / f"acc{stage}_state"
    common = ["--stage", str(stage), "--state-dir", str(state), "--save-at", "6"]
    full, res = Path(workdir) / f"acc{stage}_full.json", Path(workdir) / f"acc{stage}_resume.json"
    accelerate_launch(HERE / "accelerate_run.py", [*common, "--json", str(full)], impl)
    accelerate_launch(HERE / "accelerate_run.py", [*common, "--resume", "--json", str(res)], impl)
    return {"full": _read(full), "resume": _read(res)}


def run_lightning(stage: int, impl: str, workdir: Path) -> dict:
    """Lightning DeepSpeedStrategy, ZeRO ``stage``, 2 processes: 2 epochs with a checkpoint, then resumed."""
    out = Path(workdir) / f"pl{stage}"
    common = ["--stage", str(stage), "--out-dir", str(out)]
    torchrun(HERE / "lightning_run.py", [*common, "--phase", "full", "--json", str(out) + "_full.json"], impl)
    torchrun(HERE / "lightning_run.py", [*common, "--phase", "resume", "--json", str(out) + "_resume.json"], impl)
    return {"full": _read(str(out) + "_full.json"), "resume": _read(str(out) + "_resume.json")}
