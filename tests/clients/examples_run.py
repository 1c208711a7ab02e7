"""Run a DeepSpeedExamples script, read from the fetched snapshot, with only its data source replaced.

Launched as ``torchrun --nproc_per_node 2 examples_run.py <json-out> <path-in-repo> [script args...]``. Nothing of
DeepSpeedExamples is copied into this repository: the script (and, for the pipeline example, its ``alexnet.py``)
is read with ``git show HEAD:<path>`` from ``EXAMPLES_GIT`` at run time and executed as ``__main__`` with the
given arguments. Before it runs, this harness:

* replaces the data source: a tiny ``torchvision`` stand-in (torchvision is not installed here, and a build for
  torch 2.13 CPU would pull another torch) whose ``datasets.CIFAR10`` yields a few seeded random 3x32x32 images
  with labels instead of downloading CIFAR-10; its ``transforms`` (Compose, ToTensor, Normalize, Resize,
  CenterCrop) do what torchvision's do on tensors; ``models.AlexNet`` is the example folder's own ``alexnet.py``
  (torchvision's AlexNet, copied by the example for illustration);
* for HelloDeepSpeed's ``train_bert_ds.py`` (the DeepSpeed version of ``train_bert.py``), replaces its data source
  the same way: ``datasets.load_dataset`` yields a few seeded synthetic text lines and
  ``transformers.AutoTokenizer.from_pretrained`` a character-level tokenizer with RoBERTa's special-token ids (no
  download); and supplies minimal working versions of the small utilities it imports and this environment lacks
  (``fire.Fire`` parsing ``--name value``, ``loguru.logger``, ``pytz.timezone`` — a zone whose clock reads the
  launch time, so the ranks name the same experiment directory (the script names it per rank from the wall clock,
  to the second) — and ``sh.git`` answering "not a git repository" as the script expects outside a checkout);
* seeds torch (``torch.manual_seed(0)``) the same on every rank (``cifar10_deepspeed.py`` never seeds);
* makes ``torch.cuda.set_device`` a no-op when CUDA is absent (``pipeline_parallelism/train.py`` calls it
  unconditionally; the only non-data adaptation, needed on any CPU machine, real DeepSpeed included);
* records, without changing them, the values ``torch.nn.CrossEntropyLoss`` returns on this rank (the scripts
  print only every N steps), with the sum of each call's targets (which batch it was) and a hash of torch's RNG
  state at the call (where the random stream stood, for dropout and noisy gating), and writes them with which
  ``deepspeed`` was imported to ``<json-out>.rank<R>``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import clientrun as c  # noqa: E402

#: name -> (script in DeepSpeedExamples, arguments, config file content or None). Modes of cifar10_deepspeed.py
#: are its own flags (dtype, ZeRO stage, MoE with expert parallelism, residual MoE, top-2, noisy gating, MoE
#: parameter groups as its run_ds_moe.sh passes them).
CIFAR = "training/cifar/cifar10_deepspeed.py"
PIPE = "training/pipeline_parallelism/train.py"
BERT = "training/HelloDeepSpeed/train_bert_ds.py"
_BERT_ARGS = ["--max_seq_length", "32", "--num_layers", "2", "--num_heads", "2", "--ff_dim", "64", "--h_dim", "32",
              "--dropout", "0.0", "--batch_size", "2", "--log_every", "1", "--checkpoint_every", "2", "--dtype", "bf16"]
_CIFAR_BASE = ["--deepspeed", "-e", "1", "--log-interval", "1"]
CASES: dict[str, dict] = {
    **{f"cifar_fp32_zero{s}": {"script": CIFAR, "args": [*_CIFAR_BASE, "--dtype", "fp32", "--stage", str(s)]}
       for s in (0, 1, 2, 3)},
    "cifar_bf16_zero2": {"script": CIFAR, "args": [*_CIFAR_BASE, "--dtype", "bf16", "--stage", "2"]},
    "cifar_fp16_zero2": {"script": CIFAR, "args": [*_CIFAR_BASE, "--dtype", "fp16", "--stage", "2"]},
    "cifar_moe_ep2": {"script": CIFAR, "args": [*_CIFAR_BASE, "--dtype", "fp32", "--moe", "--ep-world-size", "2",
                                                "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample",
                                                "--moe-param-group"]},
    "cifar_moe_residual_top2_zero2": {"script": CIFAR, "args": [*_CIFAR_BASE, "--dtype", "fp32", "--stage", "2",
                                                                "--moe", "--ep-world-size", "2", "--num-experts", "2",
                                                                "--mlp-type", "residual", "--top-k", "2",
                                                                "--moe-param-group"]},
    "pipeline_alexnet": {"script": PIPE, "args": ["-p", "2", "--steps", "3", "--backend", "gloo"],
                         "config": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                                             "eps": 1e-8}},
                                    "steps_per_print": 1, "wall_clock_breakdown": False}},
    # bf16, ZeRO-1, optimizer offloaded to CPU (the script's own config): 3 steps saving at 2 and 3, then resumed
    # from its experiment directory (load_checkpoint) up to step 5.
    "hello_bert_bf16_zero1_offload": {"script": BERT, "args": [*_BERT_ARGS, "--num_iterations", "4"],
                                      "resume_args": [*_BERT_ARGS, "--num_iterations", "6"]},
}


def git_show(path: str) -> str:
    """A file of the DeepSpeedExamples snapshot at HEAD."""
    return subprocess.run(["git", f"--git-dir={c.EXAMPLES_GIT}", "show", f"HEAD:{path}"], check=True,
                          stdout=subprocess.PIPE, text=True).stdout


def snapshot_available() -> bool:
    """Whether the DeepSpeedExamples snapshot can be read."""
    return c.EXAMPLES_GIT.exists()


def run_case(case: dict, impl: str, workdir) -> dict:
    """Launch one case on 2 ranks; returns ``{"rank0": {...}, "rank1": {...}}`` (``rank<R>_resume`` too for a case
    with ``resume_args``), or ``{"refused": <error lines>}`` when the run exits with an error."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / ("ex_" + case["script"].replace("/", "_"))
    args = list(case["args"])
    if case.get("config"):
        cfg = workdir / "ds_config.json"
        cfg.write_text(json.dumps(case["config"]))
        args += ["--deepspeed_config", str(cfg)]
    env = None
    if case["script"] == BERT:
        args += ["--checkpoint_dir", str(workdir / "bert_exp")]
        # train_bert_ds.py names its experiment directory on each rank from the wall clock, to the second; ranks
        # that straddle a second would write to two directories. Its clock (pytz, see _install_bert_shims) reads
        # the launch time instead, the same on every rank.
        env = {"EXAMPLES_LAUNCH_TIME": datetime.datetime.now().replace(microsecond=0).isoformat()}
    c.torchrun(Path(__file__), [str(out), case["script"], *args], impl, timeout=400, cwd=workdir, env=env)
    result = {f"rank{r}": json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)}
    if "resume_args" in case:
        (exp_dir,) = [p.parent for p in (workdir / "bert_exp").glob("*/hparams.json")]
        args = [*case["resume_args"], "--load_checkpoint_dir", str(exp_dir)]
        c.torchrun(Path(__file__), [str(out) + "_resume", case["script"], *args], impl, timeout=400, cwd=workdir,
                   env=env)
        result |= {f"rank{r}_resume": json.loads(Path(f"{out}_resume.rank{r}").read_text()) for r in (0, 1)}
    return result


# ---- the data source stand-in -------------------------------------------------------------------------------


class _CIFAR10(torch.utils.data.Dataset):
    """CIFAR-10's interface on seeded random images: 64 training / 40 test rows, every class in the test rows."""

    def __init__(self, root=None, train=True, download=False, transform=None, target_transform=None):
        n = 64 if train else 40
        g = torch.Generator().manual_seed(0 if train else 1)
        self.data = torch.rand(n, 3, 32, 32, generator=g)
        self.targets = (torch.randint(0, 10, (n,), generator=g) if train else torch.arange(n) % 10).tolist()
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        x, y = self.data[i], self.targets[i]
        if self.transform is not None:
            x = self.transform(x)
        if self.target_transform is not None:
            y = self.target_transform(y)
        return x, y


class _Compose:
    def __init__(self, ts):
        self.ts = ts

    def __call__(self, x):
        for t in self.ts:
            x = t(x)
        return x


class _ToTensor:
    def __call__(self, x):
        return x  # the stand-in dataset already yields CHW float tensors in [0, 1], what ToTensor returns


class _Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x):
        return (x - self.mean) / self.std


class _Resize:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = x.shape[-2:]
        s = self.size
        size = (s, s * w // h) if h <= w else (s * h // w, s)
        return torch.nn.functional.interpolate(x[None], size=size, mode="bilinear", antialias=True)[0]


class _CenterCrop:
    def __init__(self, size):
        self.size = size

    def __call__(self, x):
        h, w = x.shape[-2:]
        t, left = (h - self.size) // 2, (w - self.size) // 2
        return x[..., t:t + self.size, left:left + self.size]


def _install_fake_torchvision(script: str) -> None:
    tv = types.ModuleType("torchvision")
    tv.__file__ = __file__ + " (torchvision stand-in)"
    ds = types.ModuleType("torchvision.datasets")
    ds.CIFAR10 = _CIFAR10
    tr = types.ModuleType("torchvision.transforms")
    tr.Compose, tr.ToTensor, tr.Normalize, tr.Resize, tr.CenterCrop = _Compose, _ToTensor, _Normalize, _Resize, \
        _CenterCrop
    models = types.ModuleType("torchvision.models")
    alexnet_src = str(Path(script).parent / "alexnet.py")
    if alexnet_src.startswith("training/pipeline_parallelism"):
        ns: dict = {"__name__": "alexnet"}
        exec(compile(git_show(alexnet_src), f"DeepSpeedExamples:{alexnet_src}", "exec"), ns)  # noqa: S102
        models.AlexNet = ns["AlexNet"]

    def vgg19(*a, **k):
        raise NotImplementedError("the torchvision stand-in has no VGG (the example does not use it)")

    models.vgg19 = vgg19
    tv.datasets, tv.transforms, tv.models = ds, tr, models
    import importlib.machinery

    for m in (tv, ds, tr, models):
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    sys.modules.update({"torchvision": tv, "torchvision.datasets": ds, "torchvision.transforms": tr,
                        "torchvision.models": models})


class _TextRows:
    """The part of ``datasets.Dataset`` the script uses (``filter``, ``map``, indexing, ``len``) over a list."""

    def __init__(self, rows):
        self.rows = list(rows)

    def filter(self, fn):
        return _TextRows(r for r in self.rows if fn(r))

    def map(self, fn):
        return _TextRows({**r, **fn(r)} for r in self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _load_dataset(*args, **kwargs):
    """Seeded synthetic text lines (some empty, as wikitext has) instead of downloading wikitext-2."""
    g = torch.Generator().manual_seed(5)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"]
    rows = []
    for i in range(48):
        n = int(torch.randint(3, 12, (1,), generator=g))
        rows.append({"text": " ".join(words[int(j)] for j in torch.randint(0, len(words), (n,), generator=g)) + "\n"})
        if i % 8 == 0:
            rows.append({"text": ""})
    return _TextRows(rows)


class _CharTokenizer:
    """Character-level tokenizer with RoBERTa's special ids (<s>=0, <pad>=1, </s>=2) and a <mask> id."""

    bos_token_id, pad_token_id, eos_token_id, mask_token_id = 0, 1, 2, 3
    vocab_size = 64
    all_special_ids = [0, 1, 2, 3]

    def encode(self, text, add_special_tokens=True, truncation=False, max_length=None):
        ids = [4 + ord(ch) % (self.vocab_size - 4) for ch in text]
        if truncation and max_length is not None:
            ids = ids[:max_length]
        return [self.bos_token_id, *ids, self.eos_token_id] if add_special_tokens else ids


def _fire(fn):
    """``fire.Fire(fn)`` for ``--name value`` / ``--name=value`` arguments, typed like ``fn``'s defaults."""
    import inspect

    params = inspect.signature(fn).parameters
    argv, kwargs, i = sys.argv[1:], {}, 0
    while i < len(argv):
        key, sep, val = argv[i][2:].partition("=")
        if not sep:
            i, val = i + 1, argv[i + 1]
        i += 1
        default = params[key.replace("-", "_")].default
        kwargs[key.replace("-", "_")] = type(default)(val) if isinstance(default, (int, float)) else val
    return fn(**kwargs)


def _install_bert_shims() -> None:
    import datetime
    import importlib.machinery
    import logging

    import transformers

    class _ErrorReturnCode(Exception):
        pass

    class _Git:
        def __getattr__(self, name):
            def cmd(*a, **k):
                raise {"log": err128, "diff": err129}.get(name, _ErrorReturnCode)("not a git repository")
            return cmd

    err128 = type("ErrorReturnCode_128", (_ErrorReturnCode,), {})
    err129 = type("ErrorReturnCode_129", (_ErrorReturnCode,), {})
    mods = {name: types.ModuleType(name) for name in ("datasets", "datasets.arrow_dataset", "fire", "loguru", "pytz",
                                                      "sh")}
    mods["datasets"].load_dataset = _load_dataset
    mods["datasets"].arrow_dataset = mods["datasets.arrow_dataset"]
    mods["datasets.arrow_dataset"].Dataset = _TextRows
    mods["fire"].Fire = _fire
    mods["loguru"].logger = logging.getLogger("train_bert_ds")
    logging.basicConfig(level=logging.INFO)
    class _LaunchClock(datetime.tzinfo):
        """A zone whose ``datetime.now(zone)`` reads the launch time (``EXAMPLES_LAUNCH_TIME``), on every rank."""

        def utcoffset(self, dt):
            return datetime.timedelta(0)

        def dst(self, dt):
            return None

        def tzname(self, dt):
            return "launch"

        def fromutc(self, dt):
            return datetime.datetime.fromisoformat(os.environ["EXAMPLES_LAUNCH_TIME"]).replace(tzinfo=self)

    mods["pytz"].timezone = lambda name: _LaunchClock()
    mods["sh"].git = _Git()
    mods["sh"].ErrorReturnCode_128, mods["sh"].ErrorReturnCode_129 = err128, err129
    for m in mods.values():
        m.__spec__ = importlib.machinery.ModuleSpec(m.__name__, None)
    sys.modules.update(mods)
    transformers.AutoTokenizer.from_pretrained = staticmethod(lambda *a, **k: _CharTokenizer())


def main() -> None:
    """Run the example named on the command line as ``__main__`` (see the module docstring)."""
    out, script, *args = sys.argv[1:]
    if script == BERT:
        _install_bert_shims()
    else:
        _install_fake_torchvision(script)
    torch.manual_seed(0)
    if not torch.cuda.is_available():
        torch.cuda.set_device = lambda *a, **k: None
    losses: list[float] = []
    targets: list[int] = []
    rng: list[str] = []
    orig = torch.nn.CrossEntropyLoss.forward

    def recording_forward(self, input, target):
        loss = orig(self, input, target)
        if torch.is_grad_enabled():
            losses.append(float(loss.detach().float()))
            targets.append(int(target.sum()))  # which batch it was (data order)
            rng.append(hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12])  # RNG stream position
        return loss

    torch.nn.CrossEntropyLoss.forward = recording_forward
    src = git_show(script)
    sys.argv = [script, *args]
    code = compile(src, f"DeepSpeedExamples:{script}", "exec")
    exec(code, {"__name__": "__main__", "__file__": script})  # noqa: S102
    rank = int(os.environ.get("RANK", "0"))
    Path(f"{out}.rank{rank}").write_text(json.dumps({"loss": losses, "targets": targets, "rng_state": rng,
                                                     **c.imported_deepspeed()}))


if __name__ == "__main__":
    main()
