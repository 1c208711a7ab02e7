"""The error-feedback 1-bit all-reduce on 2 and 4 gloo ranks: identity, agreement, convergence, bytes."""

from __future__ import annotations

import pytest
import torch

from microspeed.testing import run_distributed

SIZES = [700, 33, 1, 2048 + 5]  # several tensors, sizes not multiples of the block or of 8


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _checks(block: int) -> dict:
    """Run on every rank: the identity of one call, agreement, the time-average, and the bytes."""
    import torch.distributed as dist
    from microspeed_comm import CompressedAllReduce

    from microspeed import comm

    rank = dist.get_rank()
    c = CompressedAllReduce(SIZES, block_size=block)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict = {}
    real = ~c._pad  # where the tensors live in the padded layout (each starts at a block boundary)

    def layout(tensors):
        flat = torch.zeros(c.padded)
        for slot, t in zip(c._slots(flat), tensors, strict=True):
            slot.copy_(t)
        return flat

    # 1. One call from non-zero errors: out + mean_r(e'_r) + s' == mean_r(x_r) + mean_r(e_r) + s.
    c.worker_error.copy_(0.3 * torch.randn(c.padded, generator=gen)).masked_fill_(c._pad, 0.0)
    c.server_error.copy_(0.1 * torch.randn(c.server_error.numel(), generator=gen)).masked_fill_(c._server_pad, 0.0)
    xs = [torch.randn(s, generator=gen) for s in SIZES]
    x = layout(xs)
    e0, s0 = c.worker_error.clone(), torch.cat(_gather(c.server_error.clone()))
    c.average_(xs)
    result = layout(xs)
    e1, s1 = c.worker_error.clone(), torch.cat(_gather(c.server_error.clone()))
    mean = lambda t: torch.stack(_gather(t)).mean(0)  # noqa: E731
    lhs = result + mean(e1) + s1
    rhs = mean(x) + mean(e0) + s0
    out["identity_err"] = float((lhs - rhs)[real].abs().max())
    out["agree"] = all(torch.equal(r, result) for r in _gather(result))
    out["padding_error_zero"] = bool((c.worker_error[c._pad] == 0).all() and (c.server_error[c._server_pad] == 0).all())
    out["aligned"] = all(o % block == 0 for o in c.offsets)  # no scale spans two tensors

    # 2. Averaged over calls, fixed inputs: the running mean of the outputs converges to the true mean.
    c.reset()
    fixed = [torch.randn(s, generator=gen) * (1 + rank) for s in SIZES]
    true = mean(torch.cat(fixed))
    acc, errs = torch.zeros(sum(SIZES)), {}
    for t in range(1, 201):
        ys = [f.clone() for f in fixed]
        c.average_(ys)
        acc += torch.cat(ys)
        if t in (1, 10, 200):
            errs[t] = float((acc / t - true).norm() / true.norm())
    out["rel_err"] = errs

    # 3. The state is the errors only: a fresh all-reduce given them continues exactly like the used one.
    twin = CompressedAllReduce(SIZES, block_size=block)
    assert twin.load_state(c.state())
    a = [torch.randn(s, generator=gen) for s in SIZES]
    b = [t.clone() for t in a]
    c.average_(a)
    twin.average_(b)
    out["twin_equal"] = all(torch.equal(p, q) for p, q in zip(a, b, strict=True)) and \
        torch.equal(c.worker_error, twin.worker_error)

    # 4. Bytes on the wire for one call, against an fp32 all-reduce of the same values.
    big = CompressedAllReduce(1 << 20)
    comm.stats.reset()
    big.average_([torch.randn(1 << 20, generator=gen)])
    compressed = comm.stats.total_wire_bytes()
    comm.stats.reset()
    comm.all_reduce(torch.randn(1 << 20, generator=gen))
    out["ratio"] = comm.stats.total_wire_bytes() / compressed
    out["last_wire_bytes_ok"] = big.last_wire_bytes == compressed
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,block", [(2, 64), (4, 128)])
def test_compressed_allreduce(world, block):
    results = run_distributed(_checks, world_size=world, args=(block,), timeout=240)
    for r in results:
        assert r["identity_err"] < 1e-5, r
        assert r["agree"] and r["padding_error_zero"] and r["twin_equal"] and r["aligned"], r
        errs = r["rel_err"]
        assert errs[200] < 0.02, errs  # the time-average converges to the true mean ...
        assert errs[200] < errs[10] / 5 < errs[1] / 5, errs  # ... as O(1/T): error feedback at work
        assert r["ratio"] >= 26 and r["last_wire_bytes_ok"], r


def test_one_rank_is_identity():
    from microspeed_comm import CompressedAllReduce

    c = CompressedAllReduce(10)
    t = torch.randn(10)
    before = t.clone()
    c.average_([t])
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match=r"tensors: sizes \[9\], but this all-reduce was built for \[10\]"):
        c.average_([torch.zeros(9)])
    with pytest.raises(ValueError, match="block_size"):
        CompressedAllReduce(10, block_size=100)
