"""Tests of the MoE routing: the PyTorch index path and dispatcher (:mod:`microspeed_moe.routing`) against
DeepSpeed's dense einsums in this process, the Triton kernels (:mod:`microspeed_moe.kernels`) against the index
path in a child process, and the memory the index path saves over the dense one.

Why a child process: ``@triton.jit`` picks the interpreter (the only way to run the kernels on CPU tensors)
when it decorates them, i.e. when ``microspeed_moe.kernels`` is first imported, and only if
``TRITON_INTERPRET=1`` is in the environment by then. This pytest process may already have imported the kernels
(or Triton) without it, so the comparison runs in ``python test_routing.py IN OUT`` started with
``TRITON_INTERPRET=1`` and ``MICROSPEED_MOE_KERNELS=triton`` (see ``_run_triton_cases``, at the bottom): it runs
every case of ``IN`` through :func:`dispatch` and :func:`combine`, forward and backward, and saves the results in
``OUT``, which the tests here compare with the same cases run through the index path.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from microspeed_moe import routing
from microspeed_moe.routing import (
    combine,
    combine_backward_torch,
    dense_combine,
    dense_dispatch,
    dispatch,
    gather_rows_torch,
    kernel_backend,
    scatter_rows_torch,
    to_dense,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PACKAGE_ROOT = str(Path(routing.__file__).resolve().parents[1])  # the folder holding microspeed_moe/

Case = dict[str, Any]


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every test with the backend chosen by the tensors, whatever the caller's environment says."""
    monkeypatch.delenv(routing.KERNELS_ENV, raising=False)


# -- helpers -------------------------------------------------------------------------------------------------------


def _routing(tokens: int, num_experts: int, capacity: int, k: int, seed: int, extra_drop: float = 0.15
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts, slots)`` as a top-k gate with capacity makes them: k distinct random experts per token, slots
    given in DeepSpeed's order (all first choices in token order, then the second ones, ...), choices past the
    capacity dropped, plus a random ``extra_drop`` of the others (leaving holes). Dropped choices get junk
    experts (-1, or past the last expert): they must never be read."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.rand(tokens, num_experts, generator=g).argsort(dim=1)[:, :k]
    onehot = torch.nn.functional.one_hot(experts.t().reshape(-1), num_experts)
    position = ((onehot.cumsum(0) - 1) * onehot).sum(1).view(k, tokens).t()
    slots = torch.where(position < capacity, position, -1)
    slots[torch.rand(tokens, k, generator=g) < extra_drop] = -1
    junk = torch.where(torch.arange(tokens * k).view(tokens, k) % 2 == 0, -1, num_experts + 3)
    return torch.where(slots >= 0, experts, junk), slots


def _inputs(tokens: int, num_experts: int, capacity: int, hidden: int, k: int, seed: int,
            dtype: torch.dtype = torch.float32, weight_dtype: torch.dtype = torch.float32) -> Case:
    """One routing case: rows, expert outputs, weights (NaN where dropped), and upstream gradients."""
    experts, slots = _routing(tokens, num_experts, capacity, k, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    weights = torch.rand(tokens, k, generator=g).to(weight_dtype)
    weights[slots < 0] = float("nan")  # a dropped choice's weight is never read
    return {
        "x": torch.randn(tokens, hidden, generator=g).to(dtype),
        "expert_out": torch.randn(num_experts, capacity, hidden, generator=g).to(dtype),
        "weights": weights, "experts": experts, "slots": slots,
        "num_experts": num_experts, "capacity": capacity,
        "grad_dispatch": torch.randn(num_experts, capacity, hidden, generator=g).to(dtype),  # empty rows too
        "grad_combine": torch.randn(tokens, hidden, generator=g).to(dtype),
    }


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` (and its autograd history), in a transposed layout."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _run_case(case: Case) -> dict[str, torch.Tensor | None]:
    """Dispatch and combine through the public functions (whichever backend the environment picks), forward and
    backward against the case's upstream gradients; returns the results by name (None: not asked for)."""
    need_rows, need_weights = case.get("need_rows", True), case.get("need_weights", True)
    shaped = _noncontiguous if case.get("noncontiguous") else (lambda t: t)
    x = case["x"].clone().requires_grad_()
    expert_out = case["expert_out"].clone().requires_grad_(need_rows)
    weights = case["weights"].clone().requires_grad_(need_weights)
    route = (case["experts"], case["slots"])
    dispatched = dispatch(shaped(x), *route, case["num_experts"], case["capacity"])
    (grad_x,) = torch.autograd.grad(dispatched, x, case["grad_dispatch"])
    combined = combine(shaped(expert_out), *route, shaped(weights))
    wanted = [t for t in (expert_out, weights) if t.requires_grad]
    grads = list(torch.autograd.grad(combined, wanted, case["grad_combine"]))
    return {"dispatched": dispatched.detach(), "combined": combined.detach(), "grad_x": grad_x,
            "grad_expert_out": grads.pop(0) if need_rows else None,
            "grad_weights": grads.pop(0) if need_weights else None}


def _run_dense(case: Case) -> dict[str, torch.Tensor]:
    """The same as :func:`_run_case` through DeepSpeed's dense einsums, in float64 (from the case's values)."""
    x = case["x"].double().requires_grad_()
    expert_out = case["expert_out"].double().requires_grad_()
    weights = case["weights"].double().requires_grad_()
    combine_weights, dispatch_mask = to_dense(case["experts"], case["slots"], weights, case["num_experts"],
                                              case["capacity"])
    dispatched = dense_dispatch(x, dispatch_mask)
    (grad_x,) = torch.autograd.grad(dispatched, x, case["grad_dispatch"].double())
    combined = dense_combine(expert_out, combine_weights)
    grad_expert_out, grad_weights = torch.autograd.grad(combined, (expert_out, weights),
                                                        case["grad_combine"].double())
    grad_weights = torch.where(case["slots"] >= 0, grad_weights, 0)
    return {"dispatched": dispatched, "combined": combined, "grad_x": grad_x, "grad_expert_out": grad_expert_out,
            "grad_weights": grad_weights}


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for results of ``dtype`` (rounded once from an fp32 accumulation) against float64."""
    return {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
            torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2}}[dtype]


def _assert_matches(actual: dict[str, torch.Tensor | None], expected: dict[str, torch.Tensor | None]) -> None:
    """Every result of ``actual`` has the dtype of its input and matches ``expected`` within that dtype's
    tolerance; the copies of rows (dispatch forward and backward are sums of at most ``k`` exact terms, checked
    by the fp64 tolerance) and the results left out agree."""
    for name, value in actual.items():
        want = expected[name]
        if value is None or want is None:
            assert value is None and want is None, name
            continue
        assert value.shape == want.shape, name
        assert not value.isnan().any(), f"{name}: NaN (a dropped choice's weight was read)"
        torch.testing.assert_close(value.double(), want.double(), **_tolerance(value.dtype), msg=name)


# -- the index path against the dense einsums ----------------------------------------------------------------------

SHAPES = {"T8-E4-C3-H16": (8, 4, 3, 16), "T13-E3-C5-H24": (13, 3, 5, 24), "T30-E5-C4-H7": (30, 5, 4, 7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_index_path_matches_dense_einsums(shape: str, k: int, dtype: torch.dtype) -> None:
    tokens, num_experts, capacity, hidden = SHAPES[shape]
    case = _inputs(tokens, num_experts, capacity, hidden, k, seed=k + 10 * len(shape), dtype=dtype)
    assert (case["slots"] < 0).any() and (case["slots"] >= 0).any()  # some dropped, some kept
    result = _run_case(case)
    _assert_matches(result, _run_dense(case))
    assert result["dispatched"].dtype == result["combined"].dtype == result["grad_x"].dtype == dtype
    assert result["grad_expert_out"].dtype == dtype and result["grad_weights"].dtype == torch.float32
    empty = torch.ones(num_experts * capacity, dtype=torch.bool)
    empty[(case["experts"] * capacity + case["slots"])[case["slots"] >= 0]] = False
    assert (result["dispatched"].view(-1, hidden)[empty] == 0).all()  # exact zeros in the rows none took
    assert (result["grad_expert_out"].view(-1, hidden)[empty] == 0).all()
    assert (result["grad_weights"][case["slots"] < 0] == 0).all()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gradcheck_float64(k: int) -> None:
    case = _inputs(7, 3, 4, 5, k, seed=40 + k, dtype=torch.float64, weight_dtype=torch.float64)
    case["weights"] = torch.rand(7, k, dtype=torch.float64)  # finite everywhere: gradcheck perturbs them all
    route = (case["experts"], case["slots"])
    x = case["x"].requires_grad_()
    expert_out = case["expert_out"].requires_grad_()
    weights = case["weights"].requires_grad_()
    assert torch.autograd.gradcheck(lambda x: dispatch(x, *route, 3, 4), (x,))
    assert torch.autograd.gradcheck(lambda e, w: combine(e, *route, w), (expert_out, weights))
    assert torch.autograd.gradcheck(lambda x, w: combine(dispatch(x, *route, 3, 4) * 2 + 1, *route, w),
                                    (x, weights))


def test_to_dense_places_each_kept_choice() -> None:
    experts, slots = _routing(9, 4, 3, 2, seed=3)
    weights = torch.rand(9, 2)
    combine_weights, dispatch_mask = to_dense(experts, slots, weights, 4, 3)
    expected = torch.zeros(9, 4, 3)
    for t in range(9):
        for j in range(2):
            if slots[t, j] >= 0:
                expected[t, experts[t, j], slots[t, j]] = weights[t, j]
    assert torch.equal(combine_weights, expected)
    assert torch.equal(dispatch_mask, expected != 0) and dispatch_mask.dtype == torch.bool


def test_partial_gradients_and_mixed_dtypes() -> None:
    """Only the rows, or only the weights, needing a gradient gives the same values; fp32 weights with bf16 rows
    keep their dtype; non-contiguous inputs work."""
    case = _inputs(11, 3, 5, 12, 2, seed=5, dtype=torch.bfloat16, weight_dtype=torch.float32)
    full = _run_case(case)
    _assert_matches(full, _run_dense(case))
    assert full["grad_weights"].dtype == torch.float32
    rows_only = _run_case({**case, "need_weights": False, "noncontiguous": True})
    weights_only = _run_case({**case, "need_rows": False})
    assert torch.equal(rows_only["grad_expert_out"], full["grad_expert_out"])
    assert torch.equal(weights_only["grad_weights"], full["grad_weights"])
    assert torch.equal(rows_only["combined"], full["combined"])


def test_degenerate_shapes() -> None:
    """No tokens, capacity 0 (every choice dropped), k = 0 and H = 0 give zeros of the right shapes."""
    for tokens, capacity, k, hidden in [(0, 3, 2, 4), (5, 0, 2, 4), (5, 3, 0, 4), (5, 3, 2, 0)]:
        choice = torch.arange(tokens * k).view(tokens, k)
        experts, slots = choice % 2, choice // 2  # (expert, slot) pairs unique
        slots = torch.where(slots < capacity, slots, -1)
        x = torch.randn(tokens, hidden, requires_grad=True)
        weights = torch.rand(tokens, k, requires_grad=True)
        out = dispatch(x, experts, slots, 2, capacity)
        assert out.shape == (2, capacity, hidden)
        back = combine(out, experts, slots, weights)
        assert back.shape == (tokens, hidden)
        back.sum().backward()
        assert x.grad.shape == x.shape and weights.grad.shape == weights.shape


def test_primitives_directly() -> None:
    """The three primitives of the index path, on a hand-made routing (two tokens, k = 2, four rows)."""
    src = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    flat = torch.tensor([[2, -1], [0, 3]])
    weights = torch.tensor([[0.5, float("nan")], [2.0, -1.0]])
    scattered = scatter_rows_torch(src, flat, 4, weights)
    assert torch.equal(scattered, torch.tensor([[6.0, 8.0], [0.0, 0.0], [0.5, 1.0], [-3.0, -4.0]]))
    rows = torch.arange(8.0).view(4, 2)
    assert torch.equal(gather_rows_torch(rows, flat), torch.tensor([[4.0, 5.0], [6.0, 8.0]]))
    assert torch.equal(gather_rows_torch(rows, flat, weights), torch.tensor([[2.0, 2.5], [-6.0, -5.0]]))
    grad_rows, grad_weights = combine_backward_torch(src, flat, weights, rows, 4)
    assert torch.equal(grad_rows, scattered)
    assert torch.equal(grad_weights, torch.tensor([[1 * 4.0 + 2 * 5.0, 0.0], [3 * 0.0 + 4 * 1.0, 3 * 6.0 + 4 * 7.0]]))
    assert combine_backward_torch(src, flat, weights, None, 4)[1] is None
    assert combine_backward_torch(src, flat, weights, rows, None)[0] is None


# -- peak memory: index path vs dense einsums ----------------------------------------------------------------------


class _LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the tensor storages that the ops run under it allocate and that are still alive,
    after every op (the CPU has no allocator statistics): ``peak`` is the most at once. Storages made before
    the mode (the inputs) are not counted; scratch memory inside one op's kernel is not seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """Run the op, forget the storages that died, count the new ones, update the peak."""
        out = func(*args, **(kwargs or {}))
        self.live = {ptr: ref for ptr, ref in self.live.items() if not ref[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in self.live:
                    self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


def test_live_bytes_tracker() -> None:
    with _LiveBytes() as mode:
        a = torch.empty(1000)
        b = a.view(10, 100) + 1  # a view shares a's storage; b is new
        del a
        c = torch.empty(250)  # after a died: the peak stays 8000 bytes
    assert mode.peak == 8000 and b.numel() + c.numel() == 1250


def _training_step(index: bool, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, slots: torch.Tensor,
                   num_experts: int, capacity: int) -> None:
    """dispatch -> a stand-in expert (``2 * rows``) -> combine, then backward into ``x`` and ``weights``;
    the dense variant builds DeepSpeed's ``[T, E, C]`` tensors from the same routing, as its gate would."""
    if index:
        out = combine(dispatch(x, experts, slots, num_experts, capacity) * 2, experts, slots, weights)
    else:
        combine_weights, dispatch_mask = to_dense(experts, slots, weights, num_experts, capacity)
        out = dense_combine(dense_dispatch(x, dispatch_mask) * 2, combine_weights)
    out.backward(torch.ones_like(out))


def test_index_path_peak_memory_far_below_dense() -> None:
    tokens, num_experts, hidden, k = 2048, 16, 256, 2
    capacity = int(1.25 * tokens * k / num_experts)  # 320, a capacity factor of 1.25
    experts, slots = _routing(tokens, num_experts, capacity, k, seed=7, extra_drop=0.05)
    peaks = {}
    for index in (True, False):
        x = torch.randn(tokens, hidden, requires_grad=True)
        weights = torch.rand(tokens, k, requires_grad=True)
        with _LiveBytes() as mode:
            _training_step(index, x, weights, experts, slots, num_experts, capacity)
        peaks[index] = mode.peak
        assert x.grad is not None and weights.grad is not None
    expert_rows = num_experts * capacity * hidden * 4  # one fp32 [E, C, H] buffer: 5.2 MB
    assert peaks[True] <= 4 * expert_rows, peaks  # O(E*C*H): a few such buffers (rows, 2 * rows, their gradient)
    assert peaks[False] >= tokens * num_experts * capacity * 4  # at least one [T, E, C] fp32 tensor: 42 MB
    assert peaks[False] >= 4 * peaks[True], {"index": peaks[True], "dense": peaks[False]}


# -- backend choice ------------------------------------------------------------------------------------------------


def test_kernel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(8)
    assert kernel_backend(t) == "torch"
    for value, expected in [("auto", "torch"), ("", "torch"), ("triton", "triton"), (" Torch ", "torch")]:
        monkeypatch.setenv(routing.KERNELS_ENV, value)
        assert kernel_backend(t) == expected
    monkeypatch.setenv(routing.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=routing.KERNELS_ENV):
        kernel_backend(t)


def _child_env(**extra: str) -> dict[str, str]:
    """This process's environment without the backend settings, the package importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", routing.KERNELS_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def _expect_ok(script: str) -> None:
    """Run ``script`` in a fresh interpreter (its own import state); it must print ``ok``."""
    done = subprocess.run([sys.executable, "-c", script], env=_child_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_routing_imports_and_runs_without_triton() -> None:
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed
        import os, torch
        from microspeed_moe import routing
        x = torch.randn(4, 8)
        experts, slots = torch.tensor([[0], [1], [0], [1]]), torch.tensor([[0], [0], [1], [-1]])
        assert routing.kernel_backend(x) == "torch"
        routing.dispatch(x, experts, slots, 2, 2)
        os.environ["MICROSPEED_MOE_KERNELS"] = "triton"
        try:
            routing.dispatch(x, experts, slots, 2, 2)
        except ImportError as exc:
            assert "MICROSPEED_MOE_KERNELS=torch" in str(exc), exc
        else:
            raise AssertionError("forcing the kernels without Triton should fail")
        print("ok")
    """)
    _expect_ok(script)


def test_triton_kernels_refuse_cpu_tensors_without_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    script = textwrap.dedent("""
        import torch
        from microspeed_moe import kernels
        assert not kernels.INTERPRETED
        try:
            kernels.scatter_rows_triton(torch.zeros(2, 4), torch.tensor([[0], [1]]), 2)
        except ValueError as exc:
            assert str(exc).startswith("src:") and "TRITON_INTERPRET" in str(exc), exc
        else:
            raise AssertionError("CPU tensors should be refused")
        print("ok")
    """)
    _expect_ok(script)


# -- argument checks -----------------------------------------------------------------------------------------------

_X = torch.zeros(3, 4)
_E = torch.tensor([[0, 1], [1, 0], [0, 1]])
_S = torch.tensor([[0, 0], [1, 1], [2, -1]])
_W = torch.ones(3, 2)
_O = torch.zeros(2, 3, 4)

BAD_CALLS = {
    "x 1-D": (lambda: dispatch(_X[0], _E, _S, 2, 3), "x"),
    "x integer": (lambda: dispatch(_X.long(), _E, _S, 2, 3), "x"),
    "experts float": (lambda: dispatch(_X, _E.float(), _S, 2, 3), "experts"),
    "experts rows": (lambda: dispatch(_X, _E[:2], _S[:2], 2, 3), "experts"),
    "experts 1-D": (lambda: dispatch(_X, _E[:, 0], _S[:, 0], 2, 3), "experts"),
    "slots shape": (lambda: dispatch(_X, _E, _S[:, :1], 2, 3), "slots"),
    "slots bool": (lambda: dispatch(_X, _E, _S >= 0, 2, 3), "slots"),
    "slots device": (lambda: dispatch(_X, _E, _S.to("meta"), 2, 3), "slots"),
    "expert out of range": (lambda: dispatch(_X, _E + 1, _S, 2, 3), "experts"),
    "slot past capacity": (lambda: dispatch(_X, _E, _S, 2, 2), "slots"),
    "slot used twice": (lambda: dispatch(_X, _E, torch.tensor([[0, 0], [0, 1], [2, -1]]), 2, 3), "slots"),
    "num_experts 0": (lambda: dispatch(_X, _E, _S, 0, 3), "num_experts"),
    "capacity negative": (lambda: dispatch(_X, _E, _S, 2, -1), "capacity"),
    "capacity float": (lambda: dispatch(_X, _E, _S, 2, 3.0), "capacity"),
    "expert_out 2-D": (lambda: combine(_O[0], _E, _S, _W), "expert_out"),
    "weights shape": (lambda: combine(_O, _E, _S, _W[:, :1]), "weights"),
    "weights integer": (lambda: combine(_O, _E, _S, _W.long()), "weights"),
    "combine slot past capacity": (lambda: combine(_O[:, :2], _E, _S, _W), "slots"),
    "to_dense capacity": (lambda: to_dense(_E, _S, _W, 2, -2), "capacity"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_value_error_naming_the_argument(name: str) -> None:
    call, argument = BAD_CALLS[name]
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        call()


def test_non_tensor_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"^x:"):
        dispatch([[0.0]], _E, _S, 2, 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^weights:"):
        combine(_O, _E, _S, [1.0])  # type: ignore[arg-type]


# -- Triton kernels vs the index path (interpreted, in a child process) --------------------------------------------

TRITON_CASES: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    # name: ((T, E, C, H, k), options)
    "fp32-k2-H32": ((9, 4, 4, 32, 2), {}),
    "fp32-k1-H24": ((7, 3, 3, 24, 1), {}),
    "fp32-k3-H40-noncontiguous": ((8, 4, 6, 40, 3), {"noncontiguous": True}),
    "fp32-k2-H1100-two-column-blocks": ((4, 2, 4, 1100, 2), {}),
    "fp32-rows-gradient-only": ((6, 3, 3, 24, 2), {"need_weights": False}),
    "fp32-weights-gradient-only": ((6, 3, 3, 24, 2), {"need_rows": False}),
    "fp16-k2-H24-fp32-weights": ((8, 3, 4, 24, 2), {"dtype": torch.float16}),
    "bf16-k2-H24-bf16-weights": ((8, 3, 4, 24, 2), {"dtype": torch.bfloat16, "weight_dtype": torch.bfloat16}),
    "no-tokens": ((0, 2, 3, 8, 2), {}),
    "capacity-0-all-dropped": ((4, 2, 0, 8, 1), {}),
}


@functools.cache
def _triton_inputs() -> dict[str, Case]:
    """The inputs of every Triton case, deterministic (the index path reruns them from the same tensors)."""
    cases = {}
    for i, (name, ((tokens, num_experts, capacity, hidden, k), options)) in enumerate(TRITON_CASES.items()):
        dtypes = {key: options[key] for key in ("dtype", "weight_dtype") if key in options}
        case = _inputs(tokens, num_experts, capacity, hidden, k, seed=60 + i, **dtypes)
        case.update({key: value for key, value in options.items() if key not in dtypes})
        cases[name] = case
    return cases


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run all the Triton cases in one interpreted child process; return their results by case name."""
    pytest.importorskip("triton", reason="triton is not installed: the kernels cannot be compared")
    folder = tmp_path_factory.mktemp("triton")
    inputs, outputs = folder / "inputs.pt", folder / "outputs.pt"
    torch.save(_triton_inputs(), inputs)
    done = subprocess.run([sys.executable, __file__, str(inputs), str(outputs)], capture_output=True, text=True,
                          env=_child_env(TRITON_INTERPRET="1", **{routing.KERNELS_ENV: "triton"}), timeout=300)
    assert done.returncode == 0, f"the interpreted Triton run failed:\n{done.stdout}\n{done.stderr}"
    return torch.load(outputs)


@pytest.mark.parametrize("name", list(TRITON_CASES))
def test_triton_kernels_match_the_index_path(triton_results: dict[str, Any], name: str) -> None:
    case = _triton_inputs()[name]
    kernels, index = triton_results[name], _run_case(case)
    for key, value in kernels.items():
        if value is None or index[key] is None:
            assert value is None and index[key] is None, key
            continue
        assert value.dtype == index[key].dtype and value.shape == index[key].shape, key
        if key == "dispatched":
            assert torch.equal(value, index[key]), key  # copies, exactly
        else:  # fp32 sums in another order; half results may then round one ulp apart
            tolerance = {"rtol": 1e-5, "atol": 1e-5} if value.dtype == torch.float32 else _tolerance(value.dtype)
            torch.testing.assert_close(value, index[key], **tolerance, msg=key)
    dense = _run_dense(case)
    _assert_matches(kernels, {key: None if kernels[key] is None else value for key, value in dense.items()})


def test_triton_backend_was_used(triton_results: dict[str, Any]) -> None:
    """In the child, MICROSPEED_MOE_KERNELS=triton selected the kernels, and they ran in the interpreter."""
    assert triton_results["meta"] == ("triton", True)


def _run_triton_cases(inputs: str, outputs: str) -> None:
    """The child process: run every case of ``inputs`` through the (interpreted) kernels, save to ``outputs``."""
    from microspeed_moe import kernels

    assert kernels.INTERPRETED, "TRITON_INTERPRET=1 must be set before microspeed_moe.kernels is imported"
    cases = torch.load(inputs)
    results: dict[str, Any] = {name: _run_case(case) for name, case in cases.items()}
    results["meta"] = (kernel_backend(torch.zeros(1)), kernels.INTERPRETED)
    torch.save(results, outputs)


if __name__ == "__main__":
    _run_triton_cases(sys.argv[1], sys.argv[2])
