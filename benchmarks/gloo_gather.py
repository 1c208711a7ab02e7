"""Gloo all-gather over loopback: torch's collective against the point-to-point form ZeRO uses on gloo.

Usage (``torchrun`` on one machine, gloo, 1 thread per rank)::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/gloo_gather.py
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/gloo_gather.py --sizes 65536,4096

Each rank holds a bf16 shard of ``--sizes`` KiB; every variant fills the same output (every rank's shard in rank
order, checked against the expected values) and is timed over repetitions after two warm-ups:
``all_gather_into_tensor`` (gloo's ring), one ``broadcast`` per rank, ``all_to_all_single`` of the shard
repeated per peer, and ``isend``/``irecv`` to and from every peer (what
``microspeed_zero.collectives.gather_slices`` does on gloo). Rank 0 prints, per variant, the bytes received per
rank per second and the wall, user and system CPU seconds per GB received.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def variants(n: int, rank: int, world: int) -> tuple[torch.Tensor, list[tuple[str, Callable[[], None]]]]:
    """The output buffer and the all-gather variants filling it from this rank's shard of ``n`` bf16 values."""
    shard = torch.full((n,), float(rank + 1), dtype=torch.bfloat16)
    out = torch.zeros(n * world, dtype=torch.bfloat16)
    outs = list(out.chunk(world))
    repeated = torch.empty(n * world, dtype=torch.bfloat16)

    def collective() -> None:
        dist.all_gather_into_tensor(out, shard)

    def broadcasts() -> None:
        outs[rank].copy_(shard)
        for work in [dist.broadcast(outs[s], src=s, async_op=True) for s in range(world)]:
            work.wait()

    def all_to_all() -> None:
        for s in range(world):
            repeated[s * n:(s + 1) * n].copy_(shard)
        dist.all_to_all_single(out, repeated)

    def point_to_point() -> None:
        outs[rank].copy_(shard)
        ops = []
        for s in range(world):
            if s != rank:
                ops += [dist.P2POp(dist.isend, shard, s), dist.P2POp(dist.irecv, outs[s], s)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return out, [("all_gather_into_tensor", collective), ("broadcast per rank", broadcasts),
                 ("all_to_all_single", all_to_all), ("isend/irecv per peer", point_to_point)]


def main() -> None:
    """Time every variant at every size; rank 0 prints one line per (size, variant)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="65536,4096,256", help="KiB per rank, comma-separated")
    parser.add_argument("--bytes", type=float, default=2e8, help="bytes per rank to time per variant (at least 3 reps)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for kib in (int(x) for x in args.sizes.split(",")):
        nbytes = kib << 10
        out, fns = variants(nbytes // 2, rank, world)
        expected = torch.cat([torch.full((nbytes // 2,), float(s + 1), dtype=torch.bfloat16) for s in range(world)])
        for name, fn in fns:
            out.zero_()
            fn()
            assert torch.equal(out, expected), f"{name}: wrong result"
            fn()
            dist.barrier()
            reps = max(3, int(args.bytes // nbytes))
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            for _ in range(reps):
                fn()
            seconds, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            gb = reps * nbytes * (world - 1) / 1e9
            if rank == 0:
                print(f"{world} ranks, {kib:6d} KiB per rank, {name:22s}: {gb / seconds:5.2f} GB/s received per rank; "
                      f"per GB: wall {seconds / gb:.2f} s, user {(after.ru_utime - before.ru_utime) / gb:.2f} s, "
                      f"system {(after.ru_stime - before.ru_stime) / gb:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
