"""The NVMe swap folder is private: links or files planted in ``nvme_path`` are never followed nor overwritten.

Before, each rank swapped into ``<nvme_path>/microspeed_zero/rank<r>-<pid>/`` (a name anyone could predict), made
with ``exist_ok=True``, and opened its files without ``O_EXCL``/``O_NOFOLLOW``: a symlink planted at one of those
names was truncated and overwritten with float bytes. Written as the attacks:

* symlinks planted at the old predictable names (optimizer swap files, ``zero.Init(remote_device="nvme")`` shard
  files) pointing at a victim file: training runs and the victim is untouched;
* a symlink or a file planted inside a store's folder is refused with an error naming the file;
* ``<nvme_path>/microspeed_zero`` planted as a symlink to a victim folder is refused, naming it;
* the swap folder and its parent are 0700, and two engines of one process get different folders directly under
  ``<nvme_path>/microspeed_zero``, both gone after ``destroy()``.
"""

from __future__ import annotations

import gc
import os
import stat

import pytest
import torch
from microspeed_zero.nvme import SwapError, TensorFileStore

import microspeed

VICTIM = b"precious data that is not a swap file\n"


class Net(torch.nn.Module):
    """Two linear layers; ``forward(x)`` is the output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _config(nvme: str, stage: int = 2) -> dict:
    zero: dict = {"stage": stage, "sub_group_size": 64, "reduce_bucket_size": 100,
                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}
    if stage == 3:
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme, "max_in_cpu": 0}
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _train(engine, steps: int = 2) -> list[float]:
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 8, generator=gen)).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _victim(tmp_path) -> str:
    path = tmp_path / "victim.txt"
    path.write_bytes(VICTIM)
    return str(path)


def _plant(link: str, target: str) -> None:
    os.makedirs(os.path.dirname(link), exist_ok=True)
    os.symlink(target, link)


@pytest.mark.slow
def test_links_planted_at_the_old_predictable_names_are_not_followed(tmp_path):
    """An attacker who can write ``nvme_path`` plants links where the old code put this rank's swap files."""
    nvme, victim = str(tmp_path / "nvme"), _victim(tmp_path)
    old = os.path.join(nvme, "microspeed_zero", f"rank0-{os.getpid()}")
    for n in range(40):  # the optimizer swapper's folders were numbered per process
        for k, name in enumerate(("master", "exp_avg", "exp_avg_sq")):
            _plant(os.path.join(old, f"optimizer{n}", f"{k + 1:06d}-subgroup00000_{name}.swp"), victim)
    for n in range(40):  # zero.Init(remote_device="nvme"): one file per parameter, numbered per process
        _plant(os.path.join(old, "zero_init", f"param{os.getpid()}_{n}.bin"), victim)
    torch.manual_seed(0)
    with microspeed.zero.Init(remote_device="nvme", config_dict_or_path=_config(nvme, 3)):
        model = Net()
    engine, *_ = microspeed.initialize(model=model, config=_config(nvme, 3))
    losses = _train(engine)
    engine.destroy()
    del engine, model
    gc.collect()
    with open(victim, "rb") as fh:
        assert fh.read() == VICTIM, "a planted link was followed: the victim file was overwritten"
    assert all(torch.isfinite(torch.tensor(losses))), losses
    # the private folders (optimizer, parameters, zero.Init's shards) are gone; the planted ones stay
    assert os.listdir(os.path.join(nvme, "microspeed_zero")) == [os.path.basename(old)]


@pytest.mark.parametrize("plant", ["symlink", "file"])
def test_a_link_or_file_planted_in_the_store_folder_is_refused(tmp_path, plant):
    """Whatever sits at a swap file's name before the store creates it is refused, naming the file."""
    victim = _victim(tmp_path)
    store = TensorFileStore(str(tmp_path / "swap"))
    try:
        first = os.path.join(store.folder, "000001-a.swp")  # the name the first key gets
        second = os.path.join(store.folder, "000002-b.swp")
        if plant == "symlink":
            os.symlink(victim, first)
            os.symlink(victim, second)
        else:
            for path in (first, second):
                with open(path, "wb") as fh:
                    fh.write(VICTIM)
        with pytest.raises(SwapError) as info:
            store.write("a", torch.ones(64))
        assert first in str(info.value) and "this store did not create" in str(info.value)
        with pytest.raises(SwapError) as info:
            store.allocate("b", 64, torch.float32)
        assert second in str(info.value)
    finally:
        store.close()
    with open(victim, "rb") as fh:
        assert fh.read() == VICTIM
    if plant == "file":
        with open(first, "rb") as fh:  # not ours: neither written nor removed
            assert fh.read() == VICTIM


def test_a_file_swapped_for_a_link_after_creation_is_refused(tmp_path):
    """Reopening a swap file does not follow a link put in its place."""
    victim = _victim(tmp_path)
    with TensorFileStore(str(tmp_path / "swap")) as store:
        store.write("a", torch.ones(64))
        os.unlink(store.path("a"))
        os.symlink(victim, store.path("a"))
        with pytest.raises(SwapError, match=store.path("a")):
            store.write("a", torch.zeros(64))
        with pytest.raises(SwapError, match=store.path("a")):
            store.read("a")
    with open(victim, "rb") as fh:
        assert fh.read() == VICTIM


def test_a_planted_swap_root_link_is_refused(tmp_path):
    """``<nvme_path>/microspeed_zero`` planted as a link to a victim folder: initialize() refuses it, naming it."""
    nvme, target = tmp_path / "nvme", tmp_path / "victim_folder"
    target.mkdir(mode=0o700)
    nvme.mkdir()
    os.symlink(str(target), str(nvme / "microspeed_zero"))
    with pytest.raises(Exception, match="microspeed_zero.*symbolic link"):
        microspeed.initialize(model=Net(), config=_config(str(nvme)))
    assert os.listdir(target) == []


def test_swap_folders_are_private_per_engine_and_removed_at_destroy(tmp_path):
    """Mode 0700, the parent 0700, one fresh folder per engine directly under the parent, gone after destroy()."""
    nvme = str(tmp_path / "nvme")
    root = os.path.join(nvme, "microspeed_zero")
    engines = [microspeed.initialize(model=Net(), config=_config(nvme))[0] for _ in range(2)]
    folders = [e.plugin_state("zero").swapper.store.folder for e in engines]
    assert folders[0] != folders[1]
    for folder in folders:
        assert os.path.dirname(folder) == root, folders
        assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    for engine in engines:
        _train(engine, 1)
        engine.destroy()
    assert not any(os.path.exists(f) for f in folders)
