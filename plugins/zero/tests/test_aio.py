"""DeepSpeed's ``aio`` section: parsed and refused as DeepSpeed 0.19.8 defines it, acted on by the NVMe swap store."""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from microspeed_zero import aio as aio_mod
from microspeed_zero.aio import (
    AioConfig,
    AioContext,
    AlignedPool,
    aligned_empty,
    direct_io_supported,
    kernel_aio_unavailable,
)
from microspeed_zero.nvme import TensorFileStore

import microspeed
from microspeed import ConfigError

PAGE = aio_mod.ALIGN


def _direct_store(tmp_path, **kwargs) -> TensorFileStore:
    if not direct_io_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT: the swap files use buffered I/O")
    return TensorFileStore(str(tmp_path / "swap"), direct=True, **kwargs)


def _needs_kernel_aio() -> None:
    reason = kernel_aio_unavailable()
    if reason:
        pytest.skip(reason)


def _sample(nbytes: int) -> torch.Tensor:
    t = aligned_empty(nbytes // 4, torch.float32)
    t.copy_(torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(nbytes)))
    return t


def _round_trip(store: TensorFileStore, tensor: torch.Tensor) -> None:
    store.write("t", tensor)
    out = aligned_empty(tensor.numel(), tensor.dtype)
    store.read("t", out)
    assert torch.equal(out, tensor)


# -- the section -----------------------------------------------------------------------------------------


def test_defaults_and_aliases() -> None:
    assert AioConfig.from_section({}) == AioConfig(1_048_576, 8, 1, False, True)  # DeepSpeed 0.19.8's defaults
    assert AioConfig.from_section({"thread_count": 3}).intra_op_parallelism == 3
    assert AioConfig.from_section({"thread_count": 3, "intra_op_parallelism": 3}).intra_op_parallelism == 3
    with pytest.raises(ConfigError, match=r"aio\.thread_count \(3\) and aio\.intra_op_parallelism \(2\)"):
        AioConfig.from_section({"thread_count": 3, "intra_op_parallelism": 2})
    assert AioConfig(4096, 2, 3, True, False).store_options() == {
        "threads": 3, "block_size": 4096, "queue_depth": 2, "single_submit": True, "overlap_events": False,
        "direct": True}


def _init(aio: dict, nvme: str | None = None):
    zero = {"stage": 2}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": zero, "aio": aio}
    torch.manual_seed(0)
    return microspeed.initialize(model=torch.nn.Linear(4, 1), config=config)[0]


@pytest.mark.parametrize(("aio", "message"), [
    ({"use_gds": True}, r"aio\.use_gds: true asks for NVIDIA GPUDirect Storage.*Set aio\.use_gds to false"),
    ({"queue_dept": 4}, r"aio\.queue_dept.*queue_depth"),
    ({"queue_depth": "8"}, r"aio\.queue_depth: expected an integer, got '8'"),
    ({"queue_depth": 0}, r"aio\.queue_depth: got 0; expected a number > 0"),
    ({"intra_op_parallelism": True}, r"aio\.intra_op_parallelism: expected an integer, got True"),
    ({"block_size": 1000}, r"aio\.block_size: got 1000; expected a positive multiple of 4096"),
    ({"block_size": 1048576.0}, r"aio\.block_size: expected an integer, got 1048576\.0"),
    ({"single_submit": "no"}, r"aio\.single_submit: expected true/false, got 'no'"),
    ({"thread_count": 0}, r"aio\.thread_count: got 0; expected a number > 0"),
])
def test_bad_values_are_refused_naming_the_key(aio, message) -> None:
    with pytest.raises(ConfigError, match=message):
        _init(aio)


def test_section_reaches_the_swapper(tmp_path) -> None:
    engine = _init({"block_size": 8192, "queue_depth": 3, "thread_count": 2, "single_submit": True,
                    "overlap_events": False}, nvme=str(tmp_path))
    store = engine.plugin_state("zero").swapper.store
    assert (store.block_size, store.queue_depth, store.threads, store.single_submit, store.overlap_events) == (
        8192, 3, 2, True, False)
    assert store.direct == direct_io_supported(str(tmp_path))
    engine.plugin_state("zero").swapper.close()
    quiet = _init({"thread_count": 1, "queue_depth": 8}).plugin_state("zero").cfg.notices  # DeepSpeed's defaults
    assert not any(n.startswith("aio") for n in quiet)
    notices = _init({"queue_depth": 4}).plugin_state("zero").cfg.notices  # nothing is swapped: said so
    assert any(n.startswith("aio has no effect here: no zero_optimization offload device is 'nvme'") for n in notices)


# -- what each key changes in the store ------------------------------------------------------------------


@pytest.mark.parametrize("block", [PAGE, 4 * PAGE])
def test_block_size_is_the_request_size(tmp_path, block) -> None:
    with _direct_store(tmp_path, threads=1, block_size=block) as store:
        _round_trip(store, _sample(16 * PAGE))
        assert store.stats.sizes == {block: 2 * 16 * PAGE // block}  # write + read, all direct
        assert store.stats.direct_bytes == 2 * 16 * PAGE and store.stats.buffered_bytes == 0


def test_partial_page_tail_and_unaligned_memory_use_buffered_requests(tmp_path) -> None:
    with _direct_store(tmp_path, threads=1, block_size=PAGE) as store:
        _round_trip(store, _sample(3 * PAGE + 12))
        assert store.stats.sizes == {PAGE: 6, 12: 2}
        unaligned = torch.randn(4 * PAGE // 4 + 1)[1:]  # data_ptr 4 bytes past an allocation
        assert unaligned.data_ptr() % PAGE
        store.write("u", unaligned)
        out = torch.empty(4 * PAGE // 4 + 1)[1:]  # unaligned too (empty_like may land on a page boundary)
        assert out.data_ptr() % PAGE
        store.read("u", out)
        assert torch.equal(out, unaligned) and store.stats.buffered_bytes == 2 * 12 + 2 * 4 * PAGE


def test_piece_at_an_unaligned_offset_moves_its_whole_pages_direct_from_a_staging_buffer(tmp_path) -> None:
    # The optimizer writes new weights (and backward gradient pieces) at sub-group offsets that are not on a page:
    # a staging buffer placed like its file offset sends the pages between the first and last boundary direct.
    with _direct_store(tmp_path, threads=2, block_size=PAGE) as store:
        whole = _sample(8 * PAGE)
        store.write("t", whole)
        before = (store.stats.direct_bytes, store.stats.buffered_bytes)
        piece = store.staging(5 * PAGE // 4, torch.float32, offset=100)  # file bytes [400, 400 + 5 pages)
        assert (piece.data_ptr() - 400) % PAGE == 0
        piece.copy_(torch.arange(piece.numel(), dtype=torch.float32))
        store.write("t", piece, offset=100)
        direct = store.stats.direct_bytes - before[0]
        buffered = store.stats.buffered_bytes - before[1]
        assert (direct, buffered) == (4 * PAGE, PAGE)  # head 3696 + tail 400 bytes buffered
        expect = whole.clone()
        expect[100:100 + piece.numel()] = piece
        assert torch.equal(store.read("t"), expect)
        plain = torch.ones(5 * PAGE // 4 + 1)[1:]  # torch's own allocation, 4 bytes past 64-byte alignment
        before = store.stats.buffered_bytes
        store.write("t", plain, offset=100)
        assert store.stats.buffered_bytes - before == 5 * PAGE  # not placed like its offset: all buffered
        expect[100:100 + plain.numel()] = plain
        assert torch.equal(store.read("t"), expect)


def test_aligned_pool_reuses_buffers_within_its_cap() -> None:
    # Shards read from files go into pooled buffers: one given back is handed out again for the same size (no new
    # mapping, so no page faults on the refill); a buffer given back is dropped when keeping it would put the
    # bytes out and kept over the cap.
    pool = AlignedPool(cap_bytes=3 * PAGE)
    a = pool.take(PAGE // 2, torch.bfloat16)  # one page
    b = pool.take(PAGE // 4, torch.float32)  # one page, another buffer
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0 and a.data_ptr() != b.data_ptr()
    pool.give(a)  # 1 out + 1 kept
    assert pool.kept_bytes() == PAGE
    again = pool.take(PAGE // 4, torch.float32)  # the same bytes in another dtype: the kept buffer
    assert again.data_ptr() == a.data_ptr() and again.dtype == torch.float32 and again.numel() == PAGE // 4
    assert pool.kept_bytes() == 0
    other = pool.take(PAGE // 2, torch.float32)  # two pages: none kept of that size, a new one
    assert other.data_ptr() not in (a.data_ptr(), b.data_ptr())
    pool.give(other)  # 2 out + 2 kept = 4 pages > 3: dropped
    assert pool.kept_bytes() == 0
    pool.give(again)  # 1 out + 1 kept
    pool.give(b)  # 0 out + 2 kept
    assert pool.kept_bytes() == 2 * PAGE
    assert pool.take(PAGE // 2, torch.bfloat16).data_ptr() in (a.data_ptr(), b.data_ptr())
    assert pool.kept_bytes() == PAGE


@pytest.mark.parametrize("threads", [1, 3])
def test_thread_count_is_the_number_of_io_threads(tmp_path, threads) -> None:
    before = {t.ident for t in threading.enumerate()}
    with _direct_store(tmp_path, threads=threads, block_size=PAGE) as store:
        _round_trip(store, _sample(12 * PAGE))
        assert len(store.stats.threads) == threads  # each thread moved one stripe of every transfer
        assert len({t.ident for t in threading.enumerate()} - before) == threads


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_queue_depth_is_the_requests_in_flight_per_thread(tmp_path, depth) -> None:
    _needs_kernel_aio()
    with _direct_store(tmp_path, threads=1, block_size=PAGE, queue_depth=depth, overlap_events=False) as store:
        _round_trip(store, _sample(12 * PAGE))
        assert store.stats.max_in_flight == depth
        assert store.stats.submit_calls == 2 * math.ceil(12 / depth)  # one io_submit per batch of `depth`


def test_single_submit_submits_one_request_per_call(tmp_path) -> None:
    _needs_kernel_aio()
    with _direct_store(tmp_path, threads=1, block_size=PAGE, queue_depth=4, single_submit=True,
                       overlap_events=False) as store:
        _round_trip(store, _sample(12 * PAGE))
        assert store.stats.submit_calls == store.stats.requests == 24
        assert store.stats.max_in_flight == 4  # still queue_depth in flight, submitted one by one


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_events_refills_the_queue_as_requests_complete(tmp_path, monkeypatch, overlap) -> None:
    _needs_kernel_aio()
    real = AioContext._reap
    monkeypatch.setattr(AioContext, "_reap", lambda self, least, most: real(self, least, least))  # no more
    with _direct_store(tmp_path, threads=1, block_size=PAGE, queue_depth=4, overlap_events=overlap) as store:
        _round_trip(store, _sample(12 * PAGE))
        if overlap:  # a request is submitted as each one completes, beside the 3 still in flight
            assert store.stats.refills == 2 * (12 - 4) and store.stats.submit_calls == 2 * (1 + 12 - 4)
        else:  # a batch is submitted only when the previous one completed entirely
            assert store.stats.refills == 0 and store.stats.submit_calls == 2 * 3


def test_a_short_direct_read_names_the_key(tmp_path) -> None:
    with _direct_store(tmp_path, threads=1, block_size=PAGE) as store:
        store.write("exp_avg", _sample(8 * PAGE))
        os.truncate(store.path("exp_avg"), 2 * PAGE)
        with pytest.raises(OSError, match="'exp_avg'.*end of file"):
            store.read("exp_avg", aligned_empty(8 * PAGE // 4, torch.float32))


# -- a tiny training run ---------------------------------------------------------------------------------


def _losses(root: str, aio: dict | None) -> tuple[list[float], object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))
    zero = {"stage": 3, "sub_group_size": 2048, "stage3_param_persistence_threshold": 0,  # sub-groups of 2 pages
            "offload_optimizer": {"device": "nvme", "nvme_path": root},
            "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0}}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": zero, **({"aio": aio} if aio is not None else {})}
    engine = microspeed.initialize(model=model, config=config)[0]
    rt = engine.plugin_state("zero")
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        loss = torch.nn.functional.mse_loss(engine(torch.randn(4, 16, generator=g)), torch.randn(4, 1, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    stores = (rt.swapper.store, rt.stage3.store)
    stats = [(s.stats.sizes, len(s.stats.threads), s.stats.max_in_flight, s.stats.direct_bytes) for s in stores]
    rt.swapper.close()
    rt.stage3.store.close()
    return losses, stats


def test_losses_unchanged_with_other_aio_settings(tmp_path) -> None:
    base, _ = _losses(str(tmp_path / "a"), None)
    tuned, stats = _losses(str(tmp_path / "b"), {"block_size": PAGE, "queue_depth": 2, "thread_count": 3,
                                                 "single_submit": True, "overlap_events": False})
    assert tuned == base
    for sizes, threads, in_flight, direct in stats:  # the optimizer's and the parameters' files
        assert max(sizes) <= PAGE and threads >= 2 and in_flight <= 2
        if direct_io_supported(str(tmp_path)) and not kernel_aio_unavailable():
            assert direct > 0


def test_a_new_key_is_sized_before_its_first_direct_write(tmp_path) -> None:
    """ext4 serialises direct writes that grow a file: the store sets the size first (measured 0.3 -> 1.2+ GB/s)."""
    with _direct_store(tmp_path, threads=1, block_size=PAGE) as store:
        tensor = _sample(64 * PAGE)
        handle = store.write_async("fresh", tensor)
        assert os.path.getsize(store.path("fresh")) == 64 * PAGE  # before the write completes
        handle.wait()
        _round_trip(store, tensor)
