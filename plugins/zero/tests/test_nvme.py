"""Tests of the NVMe swap storage (``microspeed_zero.nvme``): files, async I/O, errors, the prefetcher."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from microspeed_zero.nvme import Prefetcher, SwapError, SwapHandle, TensorFileStore, private_folder

BLOCK = 4096  # small blocks so that modest tensors span several chunks


class RecordingStore(TensorFileStore):
    """A store whose chunk I/O can be slowed down or made to fail, and that logs every chunk."""

    def __init__(self, *args: object, read_delay: float = 0.0, write_delay: float = 0.0,
                 fail_write: int | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.read_delay = read_delay
        self.write_delay = write_delay
        self.fail_write = fail_write
        self.log: list[tuple[str, str, float, float, int]] = []  # (op, path, start, end, thread id)
        self._active = 0
        self.max_active = 0
        self._count_lock = threading.Lock()

    def _track(self, op: str, path: str, delay: float, run) -> None:
        start = time.perf_counter()
        with self._count_lock:
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            time.sleep(delay)
            run()
        finally:
            with self._count_lock:
                self._active -= 1
            self.log.append((op, path, start, time.perf_counter(), threading.get_ident()))

    def _read_chunk(self, path: str, view: memoryview, offset: int) -> None:
        self._track("read", path, self.read_delay, lambda: super(RecordingStore, self)._read_chunk(path, view, offset))

    def _write_chunk(self, path: str, view: memoryview, offset: int) -> None:
        def run() -> None:
            if self.fail_write is not None:
                raise OSError(self.fail_write, os.strerror(self.fail_write))
            super(RecordingStore, self)._write_chunk(path, view, offset)

        self._track("write", path, self.write_delay, run)

    def spans(self, op: str, key: str) -> tuple[float, float]:
        """Earliest start and latest end of the chunks of ``op`` on ``key``."""
        rows = [(s, e) for o, p, s, e, _ in self.log if o == op and p == self.path(key)]
        assert rows, f"no {op} of {key!r} logged"
        return min(s for s, _ in rows), max(e for _, e in rows)


def _sample(numel: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    return torch.randint(-(2**40), 2**40, (numel,), generator=gen, dtype=dtype)


# -- layout and round trips -------------------------------------------------------------------


def test_private_folder_names_rank_and_purpose_and_is_fresh(tmp_path):
    folders = [private_folder(str(tmp_path), 3, "optimizer") for _ in range(2)]
    assert folders[0] != folders[1]
    for folder in folders:
        assert os.path.dirname(folder) == os.path.join(str(tmp_path), "microspeed_zero")
        assert os.path.basename(folder).startswith("rank3-optimizer-") and os.listdir(folder) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 1023, 1024, 5000, 100_003])
def test_round_trip(tmp_path, dtype, numel):
    with TensorFileStore(str(tmp_path / "swap"), threads=3, block_size=BLOCK) as store:
        tensor = _sample(numel, dtype)
        store.write("t", tensor)
        assert store.numel("t") == numel and store.dtype("t") == dtype
        assert os.path.getsize(store.path("t")) == numel * tensor.element_size()
        back = store.read("t")
        assert back.dtype == dtype and back.shape == (numel,)
        assert torch.equal(back, tensor)
        out = torch.empty_like(tensor)
        handle = store.read_async("t", out)
        assert isinstance(handle, SwapHandle)
        handle.wait()
        assert handle.done()
        assert torch.equal(out, tensor)


def test_shaped_tensors_and_requires_grad(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        weight = torch.randn(37, 53, requires_grad=True)
        store.write("layer.0.weight", weight)
        out = torch.empty(53, 37)  # any shape with the same numel and dtype
        store.read("layer.0.weight", out)
        assert torch.equal(out.reshape(-1), weight.detach().reshape(-1))


def test_large_tensor_is_split_into_parallel_chunks(tmp_path):
    store = RecordingStore(str(tmp_path), threads=4, block_size=BLOCK, read_delay=0.02, write_delay=0.02)
    with store:
        tensor = _sample(8 * BLOCK // 4 + 5, torch.float32)  # 8 full blocks and a tail
        store.write("big", tensor)
        store.log.clear()
        store.max_active = 0
        assert torch.equal(store.read("big"), tensor)
        reads = [row for row in store.log if row[0] == "read"]
        assert len(reads) == 9
        assert store.max_active > 1  # several threads read the one tensor at once
        assert len({row[4] for row in reads}) > 1


def test_allocate_reserves_zero_filled_space(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        store.allocate("m", 3000, torch.float32)
        store.allocate("v", 10, torch.bfloat16)
        assert os.path.getsize(store.path("m")) == 12000
        assert store.keys() == ["m", "v"]
        assert "m" in store and len(store) == 2
        assert store.bytes_on_disk() == 12000 + 20
        assert torch.equal(store.read("m"), torch.zeros(3000))
        store.allocate("m", 3000, torch.float32)  # same layout again: a no-op
        with pytest.raises(ValueError, match="'m'"):
            store.allocate("m", 3001, torch.float32)
        store.write("m", torch.ones(3000))
        assert torch.equal(store.read("m"), torch.ones(3000))


def test_pieces_at_an_offset_and_byte_counters(tmp_path):
    with TensorFileStore(str(tmp_path), threads=3, block_size=BLOCK) as store:
        store.allocate("g", 5000, torch.bfloat16)
        whole = torch.zeros(5000, dtype=torch.bfloat16)
        for start, stop in ((0, 7), (7, 3001), (4000, 5000)):  # pieces spanning several blocks
            piece = _sample(stop - start, torch.bfloat16, seed=start)
            store.write_async("g", piece, offset=start).wait()
            whole[start:stop] = piece
        assert torch.equal(store.read("g"), whole)
        out = torch.empty(1500, dtype=torch.bfloat16)
        assert torch.equal(store.read("g", out, offset=3500), whole[3500:])
        assert store.read("g", offset=4990).numel() == 10
        assert store.bytes_written == 2 * (7 + 2994 + 1000)
        assert store.bytes_read == 2 * (5000 + 1500 + 10)
        with pytest.raises(ValueError, match="offset 4999"):
            store.write("g", torch.zeros(2, dtype=torch.bfloat16), offset=4999)
        with pytest.raises(ValueError, match="dtype"):
            store.write("g", torch.zeros(2), offset=1)
        with pytest.raises(KeyError, match="allocate"):
            store.write("new", torch.zeros(2), offset=1)


def test_mismatched_tensors_are_refused_at_the_call(tmp_path):
    with TensorFileStore(str(tmp_path)) as store:
        store.allocate("k", 100, torch.float32)
        with pytest.raises(ValueError, match="'k'.*numel 99"):
            store.write_async("k", torch.zeros(99))
        with pytest.raises(ValueError, match="'k'.*bfloat16"):
            store.read_async("k", torch.zeros(100, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="contiguous"):
            store.read_async("k", torch.zeros(200)[::2])
        with pytest.raises(TypeError):
            store.write_async("k", [0.0] * 100)


def test_remove_deletes_one_key(tmp_path):
    with TensorFileStore(str(tmp_path)) as store:
        store.write("a", torch.ones(10))
        store.write("b", torch.ones(10))
        path = store.path("a")
        store.remove("a")
        assert not os.path.exists(path)
        assert store.keys() == ["b"]
        with pytest.raises(KeyError):
            store.read("a")


# -- concurrency ------------------------------------------------------------------------------


def test_concurrent_async_reads_and_writes(tmp_path):
    with TensorFileStore(str(tmp_path), threads=4, block_size=BLOCK) as store:
        dtypes = [torch.float32, torch.bfloat16, torch.int64]
        tensors = {f"p{i}": _sample(500 + 997 * i, dtypes[i % 3], seed=i) for i in range(24)}
        handles = [store.write_async(k, t) for k, t in tensors.items()]
        for handle in handles:
            handle.wait()
        outs = {k: torch.empty_like(t) for k, t in tensors.items()}
        handles = [store.read_async(k, outs[k]) for k in tensors]
        # Overwrite half of the keys while the reads are in flight: each read still sees the old bytes.
        new = {k: t + 1 for i, (k, t) in enumerate(tensors.items()) if i % 2 == 0}
        handles += [store.write_async(k, t) for k, t in new.items()]
        for handle in handles:
            handle.wait()
        for k, t in tensors.items():
            assert torch.equal(outs[k], t), k
        for k, t in new.items():
            assert torch.equal(store.read(k), t), k
        store.synchronize()
        assert store.pending() == 0


def test_same_key_operations_keep_their_order(tmp_path):
    store = RecordingStore(str(tmp_path), threads=4, block_size=BLOCK, write_delay=0.05, read_delay=0.05)
    with store:
        first, second = torch.full((3000,), 1.0), torch.full((3000,), 2.0)
        store.allocate("k", 3000, torch.float32)
        w1 = store.write_async("k", first)
        out1 = torch.empty(3000)
        r1 = store.read_async("k", out1)  # read after write: must see `first`
        w2 = store.write_async("k", second)  # write after read: must not clobber what r1 reads
        out2 = torch.empty(3000)
        r2 = store.read_async("k", out2)
        for handle in (w1, r1, w2, r2):
            handle.wait()
        assert torch.equal(out1, first)
        assert torch.equal(out2, second)


def test_after_orders_operations_on_different_keys(tmp_path):
    store = RecordingStore(str(tmp_path), threads=4, block_size=BLOCK, write_delay=0.1)
    with store:
        store.write("a", torch.ones(100))
        store.write("b", torch.ones(100))
        store.log.clear()
        w = store.write_async("a", torch.zeros(100))
        r = store.read_async("b", torch.empty(100), after=[w])
        r.wait()
        assert w.done()
        assert store.spans("read", "b")[0] >= store.spans("write", "a")[1]


# -- errors -----------------------------------------------------------------------------------


def test_read_of_unknown_key_raises_key_error_naming_it(tmp_path):
    with TensorFileStore(str(tmp_path)) as store:
        with pytest.raises(KeyError, match="never_written"):
            store.read_async("never_written", torch.empty(1))
        with pytest.raises(KeyError, match="never_written"):
            store.read("never_written")
        with pytest.raises(KeyError, match="never_written"):
            store.numel("never_written")


def test_missing_file_is_reported_at_wait_with_key_and_path(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        store.write("exp_avg.3", torch.ones(5000))
        path = store.path("exp_avg.3")
        os.unlink(path)
        handle = store.read_async("exp_avg.3", torch.empty(5000))
        with pytest.raises(OSError) as info:
            handle.wait()
        assert isinstance(info.value, SwapError)
        assert info.value.errno == errno.ENOENT
        assert "exp_avg.3" in str(info.value) and path in str(info.value)
        assert handle.done()
        assert isinstance(handle.exception(), SwapError)


def test_truncated_file_is_reported(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        store.write("m", torch.ones(5000))
        os.truncate(store.path("m"), 100)
        with pytest.raises(OSError, match="'m'.*end of file") as info:
            store.read("m")
        assert info.value.errno == errno.EIO


def test_unwritable_folder_is_reported_at_wait(tmp_path):
    # Simulated without chmod (root ignores it): the folder is replaced by a plain file.
    folder = tmp_path / "swap"
    store = TensorFileStore(str(folder), block_size=BLOCK)
    store.allocate("master.0", 10, torch.float32)
    os.unlink(store.path("master.0"))
    os.rmdir(folder)
    folder.write_bytes(b"not a folder")
    handle = store.write_async("master.0", torch.ones(10))
    with pytest.raises(OSError) as info:
        handle.wait()
    assert "master.0" in str(info.value) and str(folder) in str(info.value)
    with pytest.raises(OSError, match="master.1"):  # a new key's file is created at once: refused at once
        store.allocate("master.1", 10, torch.float32)
    with pytest.raises(OSError, match="master.2"):
        store.write_async("master.2", torch.ones(10))
    store.close()


def test_folder_under_a_file_is_refused_at_construction(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=str(blocker / "swap")):
        TensorFileStore(str(blocker / "swap"))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root is not stopped by chmod")
def test_read_only_folder_is_reported_at_wait(tmp_path):
    folder = tmp_path / "ro"
    store = TensorFileStore(str(folder))
    os.chmod(folder, 0o500)
    try:
        with pytest.raises(OSError, match="'k'") as info:
            store.write("k", torch.ones(4))
        assert info.value.errno == errno.EACCES and str(folder) in str(info.value)
    finally:
        os.chmod(folder, 0o700)
        store.close()


def test_disk_full_is_reported_at_wait(tmp_path):
    store = RecordingStore(str(tmp_path), block_size=BLOCK, fail_write=errno.ENOSPC)
    with store:
        handle = store.write_async("grad.7", torch.ones(5000))
        with pytest.raises(OSError) as info:
            handle.wait()
        assert info.value.errno == errno.ENOSPC
        assert "grad.7" in str(info.value) and store.path("grad.7") in str(info.value)
        assert "No space left" in str(info.value)
        with pytest.raises(SwapError, match="grad.7"):  # every wait() raises it again
            handle.wait()


# -- lifetime ---------------------------------------------------------------------------------


def test_close_removes_files_and_created_folders(tmp_path):
    store = TensorFileStore.private(str(tmp_path), 0, "optimizer")
    folder = store.folder
    store.write("a", torch.ones(10))
    store.allocate("b", 10, torch.float32)
    assert len(os.listdir(folder)) == 2
    store.close()
    assert not os.path.exists(folder)
    assert os.listdir(tmp_path) == []  # the microspeed_zero folder it made is gone too
    assert store.closed
    store.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        store.write("c", torch.ones(1))


def test_close_keeps_a_folder_it_did_not_create(tmp_path):
    (tmp_path / "other").write_text("keep me")
    with TensorFileStore(str(tmp_path)) as store:
        store.write("a", torch.ones(10))
    assert sorted(os.listdir(tmp_path)) == ["other"]


def test_close_without_remove_keeps_files(tmp_path):
    store = TensorFileStore(str(tmp_path / "s"))
    store.write("a", torch.ones(10))
    path = store.path("a")
    store.close(remove=False)
    assert os.path.getsize(path) == 40


def test_close_waits_for_pending_io(tmp_path):
    store = RecordingStore(str(tmp_path / "s"), write_delay=0.1)
    store.write_async("a", torch.ones(10))
    store.close()
    assert [row[0] for row in store.log] == ["write"]
    assert not (tmp_path / "s").exists()


def test_garbage_collected_store_removes_its_files(tmp_path):
    store = TensorFileStore(str(tmp_path / "s"))
    store.write("a", torch.ones(10))
    del store
    gc.collect()
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_files_removed_at_interpreter_exit(tmp_path):
    folder = tmp_path / "s"
    code = (
        "import sys, torch\n"
        "from microspeed_zero.nvme import TensorFileStore\n"
        "store = TensorFileStore(sys.argv[1])\n"
        "store.write('a', torch.ones(1000))\n"
        "store.write_async('b', torch.ones(1000))\n"
        "assert len(store.keys()) == 2\n"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True, timeout=120)
    assert not folder.exists()


# -- Prefetcher -------------------------------------------------------------------------------


def _fill_groups(store: TensorFileStore, sizes: list[int]) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    groups, data = [], {}
    for i, numel in enumerate(sizes):
        keys = [f"master.{i}", f"exp_avg.{i}", f"exp_avg_sq.{i}"]
        for j, key in enumerate(keys):
            data[key] = _sample(numel, torch.float32, seed=10 * i + j)
            store.write(key, data[key])
        groups.append(keys)
    return groups, data


@pytest.mark.parametrize("buffer_count", [1, 2, 3, 8])
def test_prefetcher_visits_every_group_in_order(tmp_path, buffer_count):
    with TensorFileStore(str(tmp_path), threads=3, block_size=BLOCK) as store:
        groups, data = _fill_groups(store, [1000, 7000, 3, 2500, 4096])
        pre = Prefetcher(store, groups, buffer_count=buffer_count)
        assert pre.buffer_count == min(buffer_count, len(groups))
        seen = []
        for index, tensors in pre:
            seen.append(index)
            assert len(tensors) == 3
            for key, tensor in zip(groups[index], tensors, strict=True):
                assert torch.equal(tensor, data[key]), key
        assert seen == list(range(5))
        assert len(pre) == 5


def test_prefetcher_writes_back_only_dirty_groups(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        groups, data = _fill_groups(store, [1000, 2000, 1500, 900])
        pre = Prefetcher(store, groups, buffer_count=2)
        for step in range(2):  # the same prefetcher serves every optimizer step
            for index, (master, exp_avg, exp_avg_sq) in pre:
                master.add_(1.0)
                exp_avg.mul_(2.0)
                exp_avg_sq.zero_()
                if index % 2 == 0:
                    pre.mark_dirty()
            for index, keys in enumerate(groups):
                expect = (step + 1) if index % 2 == 0 else 0
                assert torch.allclose(store.read(keys[0]), data[keys[0]] + expect)
                assert torch.equal(store.read(keys[1]), data[keys[1]] * 2**expect)
        with pytest.raises(RuntimeError, match="mark_dirty"):
            pre.mark_dirty()


def test_prefetcher_writeback_flag_writes_every_group(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        groups, data = _fill_groups(store, [100, 200, 300])
        for _, tensors in Prefetcher(store, groups, writeback=True):
            for tensor in tensors:
                tensor.neg_()
        for key, value in data.items():
            assert torch.equal(store.read(key), -value)
        assert store.pending() == 0


def test_prefetcher_holds_at_most_buffer_count_slots(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        sizes = [3000, 1000, 5000, 2000, 4000, 1000, 3000, 2500] * 2
        groups, _ = _fill_groups(store, sizes)
        pre = Prefetcher(store, groups, buffer_count=3)
        largest = max(sizes) * 4 * 3
        assert pre.buffer_count == 3
        assert pre.resident_bytes() <= 3 * (largest + 3 * 64)
        assert pre.resident_bytes() < store.bytes_on_disk() / 2
        pointers = set()
        for _, tensors in pre:
            pointers.add(tensors[0].data_ptr())
            pre.mark_dirty()
            assert pre.resident_bytes() <= 3 * (largest + 3 * 64)
        assert len(pointers) == 3  # slots are reused, never more than buffer_count


def test_prefetcher_overlaps_reads_with_compute(tmp_path):
    read_s, compute_s, count = 0.1, 0.1, 6
    store = RecordingStore(str(tmp_path), threads=2, block_size=1 << 20, read_delay=read_s)
    with store:
        groups = [[f"g{i}"] for i in range(count)]
        for (key,) in groups:
            store.write(key, torch.ones(256))
        compute_end = {}
        start = time.perf_counter()
        for index, _ in Prefetcher(store, groups, buffer_count=2):
            time.sleep(compute_s)
            compute_end[index] = time.perf_counter()
        elapsed = time.perf_counter() - start
        for i in range(count - 1):
            # the read of group i+1 was started before the caller finished computing on group i
            assert store.spans("read", f"g{i + 1}")[0] < compute_end[i]
        serial = count * (read_s + compute_s)
        assert elapsed < 0.9 * serial, (elapsed, serial)


def test_prefetcher_reuses_a_slot_only_after_its_write(tmp_path):
    store = RecordingStore(str(tmp_path), threads=4, block_size=BLOCK, write_delay=0.05)
    with store:
        groups, data = _fill_groups(store, [2000, 2000, 2000, 2000, 2000])
        store.log.clear()
        for _, tensors in Prefetcher(store, groups, buffer_count=2, writeback=True):
            tensors[0].add_(1.0)
        for i in range(len(groups) - 2):
            for key_i, key_next in zip(groups[i], groups[i + 2], strict=True):
                assert store.spans("read", key_next)[0] >= store.spans("write", key_i)[1]
        for key in (keys[0] for keys in groups):
            assert torch.allclose(store.read(key), data[key] + 1)


def test_prefetcher_early_exit_writes_back_and_drains(tmp_path):
    store = RecordingStore(str(tmp_path), threads=2, block_size=BLOCK, read_delay=0.02, write_delay=0.02)
    with store:
        groups, data = _fill_groups(store, [1000] * 6)
        pre = Prefetcher(store, groups, buffer_count=3)
        for index, tensors in pre:
            tensors[0].fill_(7.0)
            pre.mark_dirty()
            if index == 1:
                break
        assert store.pending() == 0
        assert torch.equal(store.read("master.1"), torch.full((1000,), 7.0))
        assert torch.equal(store.read("master.2"), data["master.2"])
        # and the prefetcher can be iterated again afterwards
        assert [i for i, _ in pre] == list(range(6))


def test_prefetcher_with_given_buffers(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        groups, data = _fill_groups(store, [100, 300, 200])
        buffers = [[torch.empty(300) for _ in range(3)] for _ in range(2)]
        pre = Prefetcher(store, groups, buffers=buffers)
        assert pre.buffer_count == 2 and pre.resident_bytes() == 2 * 3 * 300 * 4
        for index, tensors in pre:
            assert tensors[0].data_ptr() == buffers[index % 2][0].data_ptr()
            assert torch.equal(tensors[2], data[groups[index][2]])
        with pytest.raises(ValueError, match="master.1.*needs 1200"):
            Prefetcher(store, groups, buffers=[[torch.empty(100) for _ in range(3)]])


def test_prefetcher_mixed_dtypes_in_a_group(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        groups, data = [], {}
        for i, numel in enumerate([1001, 77, 3000]):
            keys = [f"w16.{i}", f"w32.{i}"]
            data[keys[0]] = _sample(numel, torch.bfloat16, seed=i)
            data[keys[1]] = _sample(numel, torch.float32, seed=i)
            for key in keys:
                store.write(key, data[key])
            groups.append(keys)
        for index, (w16, w32) in Prefetcher(store, groups, writeback=True):
            assert w16.dtype == torch.bfloat16 and w32.dtype == torch.float32
            assert torch.equal(w16, data[groups[index][0]]) and torch.equal(w32, data[groups[index][1]])
            w16.copy_(w32)
        for keys in groups:
            assert torch.equal(store.read(keys[0]), data[keys[1]].bfloat16())


def test_prefetcher_surfaces_read_errors_naming_the_key(tmp_path):
    with TensorFileStore(str(tmp_path), block_size=BLOCK) as store:
        groups, _ = _fill_groups(store, [100, 100, 100])
        os.unlink(store.path("exp_avg.2"))
        pre = Prefetcher(store, groups)
        seen = []
        with pytest.raises(OSError, match="exp_avg.2"):
            for index, _ in pre:
                seen.append(index)
        assert seen == [0, 1]
        assert store.pending() == 0
        with pytest.raises(KeyError, match="nope"):
            Prefetcher(store, [["nope"]])
