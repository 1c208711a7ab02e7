"""initialize(training_data=...): micro-batches, collate_fn, drop_last, sharding, epochs, resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import microspeed
from microspeed.builtin.dataloader import MicroBatchLoader
from microspeed.testing import run_distributed


def _dataset(n):
    return TensorDataset(torch.arange(n), torch.arange(n).float().unsqueeze(1) * 10)


def _loader(n, micro=4, **extra):
    cfg = {"train_micro_batch_size_per_gpu": micro, **extra}
    return microspeed.initialize(model=torch.nn.Linear(1, 1), config=cfg, training_data=_dataset(n))[2]


def _epoch(loader):
    return [batch[0].tolist() for batch in loader]


def test_training_data_gives_micro_batches(tiny_model):
    engine, _, loader, _ = microspeed.initialize(model=tiny_model, training_data=_dataset(20),
                                                 config={"train_micro_batch_size_per_gpu": 4,
                                                         "gradient_accumulation_steps": 2})
    assert isinstance(loader, MicroBatchLoader) and engine.training_dataloader is loader
    assert len(loader) == 5
    batches = list(loader)
    assert len(batches) == 5
    for idx, y in batches:
        assert idx.shape == (4,) and y.shape == (4, 1)
        torch.testing.assert_close(y.squeeze(1), idx.float() * 10)  # samples stay whole
    assert sorted(i for idx, _ in batches for i in idx.tolist()) == list(range(20))


def test_training_data_may_be_a_list_as_in_deepspeed():
    """DeepSpeed takes any map-style dataset (``__getitem__`` and ``__len__``): a list of samples too."""
    samples = [(torch.tensor([float(i)]), torch.tensor([10.0 * i])) for i in range(6)]
    engine, _, loader, _ = microspeed.initialize(model=torch.nn.Linear(1, 1), training_data=samples,
                                                 config={"train_micro_batch_size_per_gpu": 2})
    batches = list(loader)
    assert len(batches) == 3 and all(x.shape == (2, 1) and y.shape == (2, 1) for x, y in batches)
    assert sorted(v for x, _ in batches for v in x.squeeze(1).tolist()) == [float(i) for i in range(6)]
    torch.testing.assert_close(torch.cat([y for _, y in batches]), torch.cat([x for x, _ in batches]) * 10)


def test_training_data_must_be_indexable(tiny_model):
    with pytest.raises(microspeed.ConfigError, match="expected a map-style dataset.*got generator"):
        microspeed.initialize(model=tiny_model, training_data=(i for i in range(3)), config={"train_batch_size": 2})

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(microspeed.ConfigError, match="IterableDataset, which cannot be sharded"):
        microspeed.initialize(model=tiny_model, training_data=Stream(), config={"train_batch_size": 2})


def test_collate_fn_is_used():
    calls = []

    def collate(items):
        calls.append(len(items))
        return {"idx": torch.stack([i for i, _ in items]), "n": len(items)}

    _, _, loader, _ = microspeed.initialize(model=torch.nn.Linear(1, 1), training_data=_dataset(10),
                                            collate_fn=collate, config={"train_micro_batch_size_per_gpu": 4})
    batches = list(loader)
    assert [b["n"] for b in batches] == [4, 4, 2] and calls == [4, 4, 2]
    assert sorted(torch.cat([b["idx"] for b in batches]).tolist()) == list(range(10))


@pytest.mark.parametrize("drop_last, sizes", [(False, [4, 4, 2]), (True, [4, 4])])
def test_dataloader_drop_last(drop_last, sizes):
    loader = _loader(10, dataloader_drop_last=drop_last)
    assert len(loader) == len(sizes)
    assert [len(b) for b in _epoch(loader)] == sizes


def test_order_changes_between_epochs_and_is_reproducible():
    a, b = _loader(32), _loader(32)
    a0, a1, a2 = _epoch(a), _epoch(a), _epoch(a)
    assert sorted(sum(a0, [])) == sorted(sum(a1, [])) == list(range(32))
    assert a0 != a1 and a1 != a2
    assert sum(a0, []) != list(range(32))  # shuffled
    assert [_epoch(b), _epoch(b), _epoch(b)] == [a0, a1, a2]  # same seed, same orders


def test_repeating_loader_restarts():
    assert microspeed.RepeatingLoader is microspeed.builtin.dataloader.RepeatingLoader
    it = microspeed.RepeatingLoader([1, 2, 3])
    assert iter(it) is it
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]

    reference = _loader(12)
    expected = sum((_epoch(reference) for _ in range(3)), [])
    repeating = microspeed.RepeatingLoader(_loader(12))
    got = [next(repeating)[0].tolist() for _ in range(9)]  # 3 epochs of 3 micro-batches
    assert got == expected
    assert got[:3] != got[3:6]  # each restart is a new epoch with a new order


def test_state_dict_resumes_mid_epoch():
    original = _loader(24)
    _epoch(original)  # finish epoch 0
    it = iter(original)
    seen = [next(it)[0].tolist() for _ in range(2)]
    state = original.state_dict()
    assert state == {"epoch": 1, "consumed": 2}
    remaining = [b[0].tolist() for b in it]
    assert len(seen) + len(remaining) == 6
    following_epoch = _epoch(original)

    resumed = _loader(24)
    resumed.load_state_dict(state)
    assert _epoch(resumed) == remaining
    assert _epoch(resumed) == following_epoch
    assert resumed.state_dict() == original.state_dict() == {"epoch": 3, "consumed": 0}


def _sharding_body(n):
    """Each rank's micro-batches for two epochs, and epoch 0 again from a second engine."""
    cfg = {"train_micro_batch_size_per_gpu": 2}
    _, _, loader, _ = microspeed.initialize(model=torch.nn.Linear(1, 1), config=cfg, training_data=_dataset(n))
    epochs = [_epoch(loader), _epoch(loader)]
    _, _, again, _ = microspeed.initialize(model=torch.nn.Linear(1, 1), config=cfg, training_data=_dataset(n))
    return epochs, _epoch(again), len(loader)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_see_disjoint_shards_covering_the_dataset():
    n = 20
    (r0_epochs, r0_again, r0_len), (r1_epochs, r1_again, r1_len) = run_distributed(
        _sharding_body, world_size=2, args=(n,), timeout=100)
    assert r0_len == r1_len == 5
    for e in range(2):
        s0, s1 = sum(r0_epochs[e], []), sum(r1_epochs[e], [])
        assert all(len(b) == 2 for b in r0_epochs[e] + r1_epochs[e])
        assert len(s0) == len(s1) == n // 2
        assert not set(s0) & set(s1), f"epoch {e}: ranks share samples"
        assert sorted(s0 + s1) == list(range(n))
    assert r0_epochs[0] != r0_epochs[1] and r1_epochs[0] != r1_epochs[1]
    assert r0_again == r0_epochs[0] and r1_again == r1_epochs[0]


def test_starting_an_epoch_draws_from_the_global_rng_as_a_torch_dataloader_does():
    """DeepSpeed's loader is a plain DataLoader: each epoch's iterator draws its base seed from torch's RNG.

    Clients compare the random draws after the first batch (dropout, noisy gates) with DeepSpeed's.
    """
    from torch.utils.data import DataLoader

    from microspeed.builtin.dataloader import MicroBatchLoader

    data = [torch.tensor([float(i)]) for i in range(8)]
    torch.manual_seed(3)
    next(iter(MicroBatchLoader(data, 2, 1, 0)))
    ours = torch.rand(4)
    torch.manual_seed(3)
    next(iter(DataLoader(data, batch_size=2)))
    assert torch.equal(ours, torch.rand(4))
    torch.manual_seed(3)
    assert not torch.equal(ours, torch.rand(4))  # the draw happened: the check can fail
