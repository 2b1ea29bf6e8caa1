"""Hugging Face checkpointing against savepoint's integrations, same model, same process.

A GPT-2 built from a config (no download; ``--layers`` x ``--width``, GPT-2's vocabulary: 82M
parameters, 330 MB, at the defaults) after one AdamW step, so a checkpoint holds the weights and
two moment buffers (about 1 GB). Each save is timed two ways:

- blocking: until the call returns (what the training loop waits for);
- durable: until every byte written is on disk. accelerate and Trainer do not fsync, so their
  durable time is the call plus an fsync of every file and directory they wrote; savepoint's
  saves return durable (blocking = durable), except ``AsyncCheckpointer``, whose ``save()``
  returns after copying the state to a staging buffer and whose durable time is ``wait()``.

Contenders (each round runs every contender once, the order alternating; round 0 warms up):

- accelerate: ``accelerator.save_state(dir)`` (safetensors weights, pickled optimizer and RNG) vs
  ``savepoint.integrations.accelerate.save_state(accelerator, path)`` vs
  ``sp.AsyncCheckpointer().save(path, accelerator_state(accelerator))``;
- transformers: ``Trainer._save_checkpoint`` (Trainer's own checkpoint at a save event) vs
  ``SavepointTrainer._save_checkpoint`` (one savepoint checkpoint instead) vs a plain Trainer
  with ``SavepointCallback`` (Trainer's checkpoint, then the savepoint one in its place).

Medians of ``--repeat`` rounds, ratios savepoint / framework (below 1: savepoint faster)::

    python benchmarks/bench_hf.py [--layers 6] [--width 768] [--repeat 5] [--dir /tmp]

Hugging Face sharded export (``--only export``, issue 30): a savepoint checkpoint of
``--export-mib`` MiB of float32 weights (``--export-gib 4`` for the issue's 4 GiB target; an
embedding-sized tensor, then layers of 4 to 48 MiB) exported with ``sp.export(..., hf=True,
max_shard_size=--shard-size)``. Contenders, each round running every one once, the order
reversed every other round (round 0 warms up):

- raw copy + fsync: the same bytes (the checkpoint's data files) copied by ``shutil.copyfile``
  (in the kernel: ``sendfile``), then an fsync of each file and of the directory, as the
  export's files are durable;
- ``sp.export(hf=True)`` (a local checkpoint's tensors are copied by the kernel and checked in
  the written file: ``savepoint.formats._kernel_copy``);
- with ``--pipeline``: the same export forced through the staging-buffer pipeline (what a
  source not stored raw takes), for comparison;
- peers (unless ``--no-peers``): ``huggingface_hub.save_torch_state_dict`` (the sharded writer
  of ``save_pretrained``) of the same state already in memory as torch tensors,
  ``transformers``' ``PreTrainedModel.save_pretrained`` of a model whose parameters are those
  tensors (shared, not copied), and
  ``dcp_to_torch_save`` of the same weights saved by ``dcp.save`` beforehand, each + fsync.

Page cache: before each contender its source files are read once (warm, the default) or
evicted (``--cold``: fsync + ``POSIX_FADV_DONTNEED``), the same for all. The export's target
ratio is throughput against the raw copy, the median of the per-round ratios (each round's
copy and export ran back to back): at least 0.8 at 4 GiB. Peak extra memory is
``RssAnon + RssShmem`` (anonymous memory: Python, numpy, staging buffers; not the page cache)
sampled every millisecond in a thread (around every contender, so each pays the same sampling),
against the largest tensor (target at most 2x). The last lines say whether each target is met::

    python benchmarks/bench_hf.py --only export [--export-mib 1024 | --export-gib 4] \
        [--shard-size 1GB] [--repeat 5] [--cold] [--pipeline] [--no-peers] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from bench_save_load import evict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")


def fsync_tree(path: str) -> None:
    """fsync every file under ``path``, then every directory, then ``path``'s parent."""
    dirs = []
    for root, _, files in os.walk(path):
        dirs.append(root)
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    dirs.append(os.path.dirname(os.path.abspath(path)))
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def size_of(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files
    )


Timing = tuple[float, float, int]  # blocking s, durable s, bytes written
Contender = Callable[[str], Timing]


def run(contenders: dict[str, Contender], root: str, repeat: int) -> dict[str, list[Timing]]:
    results: dict[str, list[Timing]] = {name: [] for name in contenders}
    for rnd in range(repeat + 1):
        order = list(contenders.items())
        if rnd % 2:
            order.reverse()
        for name, fn in order:
            path = os.path.join(root, f"{name.replace(' ', '_')}-{rnd}")
            timing = fn(path)
            if os.path.exists(path):
                shutil.rmtree(path)
            if rnd:
                results[name].append(timing)
    return results


def report(title: str, results: dict[str, list[Timing]], baseline: str) -> None:
    print(title)
    med = {
        k: (statistics.median(b for b, _, _ in v), statistics.median(d for _, d, _ in v), v[0][2])
        for k, v in results.items()
    }
    base_b, base_d, _ = med[baseline]
    for name, (b, d, n) in med.items():
        ratio = (
            ""
            if name == baseline
            else f"   ratio blocking {b / base_b:.2f}, durable {d / base_d:.2f}"
        )
        print(
            f"  {name:<28} blocking {b:7.3f} s   durable {d:7.3f} s   "
            f"{n / 1e6:8.1f} MB   {n / d / 1e6:7.0f} MB/s durable{ratio}"
        )


def make_model(layers: int, width: int):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64))
    return GPT2LMHeadModel(config)


def bench_accelerate(args: argparse.Namespace, root: str) -> None:
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import savepoint as sp
    from savepoint.integrations.accelerate import accelerator_state, save_state

    AcceleratorState._reset_state(True)
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = make_model(args.layers, args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LinearLR(opt)
    model, opt, sched = acc.prepare(model, opt, sched)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    params = sum(p.numel() for p in model.parameters())

    def framework(path: str) -> Timing:
        t = time.perf_counter()
        acc.save_state(path)
        blocking = time.perf_counter() - t
        fsync_tree(path)
        return blocking, time.perf_counter() - t, size_of(path)

    def savepoint_sync(path: str) -> Timing:
        t = time.perf_counter()
        save_state(acc, path)
        elapsed = time.perf_counter() - t
        return elapsed, elapsed, size_of(path)

    checkpointer = sp.AsyncCheckpointer()

    def savepoint_async(path: str) -> Timing:
        t = time.perf_counter()
        checkpointer.save(path, {**accelerator_state(acc), "extra": None})
        blocking = time.perf_counter() - t
        checkpointer.wait()
        return blocking, time.perf_counter() - t, size_of(path)

    try:
        results = run(
            {
                "accelerator.save_state": framework,
                "savepoint save_state": savepoint_sync,
                "savepoint AsyncCheckpointer": savepoint_async,
            },
            root,
            args.repeat,
        )
    finally:
        checkpointer.close()
    report(
        f"accelerate {sys_version('accelerate')}: GPT-2 {args.layers}x{args.width}, "
        f"{params / 1e6:.0f}M parameters + AdamW state, {args.repeat} rounds, medians",
        results,
        "accelerator.save_state",
    )


def bench_trainer(args: argparse.Namespace, root: str) -> None:
    import torch
    from transformers import Trainer, TrainingArguments

    from savepoint.integrations.transformers import SavepointTrainer

    class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = torch.arange(16) + i
            return {"input_ids": ids, "labels": ids}

    torch.manual_seed(0)
    model = make_model(args.layers, args.width)
    out = os.path.join(root, "trainer")
    training = TrainingArguments(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        log_level="error",
    )
    trainer = SavepointTrainer(model=model, args=training, train_dataset=Tokens())
    trainer.train()  # one step: the optimizer has its state
    trainer.args.save_strategy = "steps"
    callback = trainer.savepoint_callback
    assert callback is not None
    params = sum(p.numel() for p in model.parameters())
    step = [1000]

    def checkpoint_dir() -> str:
        step[0] += 1
        trainer.state.global_step = step[0]
        return os.path.join(out, f"checkpoint-{step[0]}")

    def framework(path: str) -> Timing:
        target = checkpoint_dir()
        t = time.perf_counter()
        Trainer._save_checkpoint(trainer, trainer.model, None)
        blocking = time.perf_counter() - t
        fsync_tree(target)
        durable = time.perf_counter() - t
        os.rename(target, path)
        return blocking, durable, size_of(path)

    def savepoint_trainer(path: str) -> Timing:
        target = checkpoint_dir()
        t = time.perf_counter()
        trainer._save_checkpoint(trainer.model, None)
        elapsed = time.perf_counter() - t
        callback._trainer_wrote = False
        os.rename(target, path)
        return elapsed, elapsed, size_of(path)

    def plain_with_callback(path: str) -> Timing:
        target = checkpoint_dir()
        t = time.perf_counter()
        Trainer._save_checkpoint(trainer, trainer.model, None)
        callback.on_save(
            trainer.args,
            trainer.state,
            trainer.control,
            model=trainer.model,
            optimizer=trainer.optimizer,
            lr_scheduler=trainer.lr_scheduler,
        )
        elapsed = time.perf_counter() - t
        os.rename(target, path)
        return elapsed, elapsed, size_of(path)

    results = run(
        {
            "Trainer checkpoint": framework,
            "SavepointTrainer": savepoint_trainer,
            "Trainer + SavepointCallback": plain_with_callback,
        },
        root,
        args.repeat,
    )
    report(
        f"transformers {sys_version('transformers')} Trainer: GPT-2 {args.layers}x{args.width}, "
        f"{params / 1e6:.0f}M parameters + AdamW state, {args.repeat} rounds, medians",
        results,
        "Trainer checkpoint",
    )


class PeakAnon:
    """The peak of ``RssAnon + RssShmem`` (anonymous resident memory; the staging buffers are
    shared anonymous mappings, counted as shmem) above its value at entry, sampled every
    millisecond in a thread while the block runs."""

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()

    @staticmethod
    def anon() -> int:
        total = 0
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
        return total

    def __enter__(self) -> PeakAnon:
        self.start = self.peak = self.anon()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.anon())
            time.sleep(0.001)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.anon())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def export_state(total: int) -> dict[str, Any]:
    """float32 weights of about ``total`` bytes: an embedding of an eighth of them (at most 512
    MiB), then layers cycling through 4, 16, 48 and 24 MiB."""
    import numpy as np

    rng = np.random.default_rng(0)
    model: dict[str, Any] = {}
    embed = min(total // 8, 512 << 20) // 4
    model["embed.weight"] = rng.standard_normal(embed, dtype=np.float32)
    left, i = total - embed * 4, 0
    sizes = (4 << 20, 16 << 20, 48 << 20, 24 << 20)
    while left > 0:
        n = min(sizes[i % len(sizes)], left) // 4
        model[f"layers.{i}.weight"] = rng.standard_normal(max(n, 1), dtype=np.float32)
        left -= max(n, 1) * 4
        i += 1
    return {"model": model, "step": 1}


def _pretrained(tensors: dict[str, Any]) -> Any:
    """A ``transformers.PreTrainedModel`` whose parameters are ``tensors`` (shared, not copied),
    for timing ``save_pretrained`` on the same bytes as the export."""
    import torch
    from transformers import PretrainedConfig, PreTrainedModel

    class Holder(PreTrainedModel):  # type: ignore[misc]
        config_class = PretrainedConfig
        base_model_prefix = "holder"

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.weights = torch.nn.ParameterDict(
                {
                    k.replace(".", "_"): torch.nn.Parameter(v, requires_grad=False)
                    for k, v in tensors.items()
                }
            )

    return Holder(PretrainedConfig())


def bench_export(args: argparse.Namespace, root: str) -> None:
    import savepoint as sp
    from savepoint.formats import _kernel_copy

    total = (args.export_gib << 30) if args.export_gib else (args.export_mib << 20)
    state = export_state(total)
    largest = max(v.nbytes for v in state["model"].values())
    ckpt = os.path.join(root, "ckpt")
    sp.save(ckpt, state)
    data = sorted(f for f in os.listdir(ckpt) if f.endswith(".safetensors"))  # the data files
    nbytes = sum(v.nbytes for v in state["model"].values())
    tensors: dict[str, Any] = {}  # the peer's state, in memory as torch tensors
    if args.peers:
        import torch

        tensors = {k: torch.from_numpy(v) for k, v in state["model"].items()}
    peaks: dict[str, list[int]] = {}

    def prepare_dir(where: str, names: list[str] | None = None) -> None:
        # The same page-cache state for every contender: the source's files on disk and out of
        # the cache (--cold), or read once into it (warm).
        for name in names if names is not None else os.listdir(where):
            if args.cold:
                evict(os.path.join(where, name))
            else:
                with open(os.path.join(where, name), "rb") as f:
                    while f.read(64 << 20):
                        pass

    def prepare() -> None:
        prepare_dir(ckpt, data)

    def raw_copy(path: str) -> Timing:
        prepare()
        with PeakAnon() as mem:  # sampled as the export is: the same sampling thread
            t = time.perf_counter()
            os.mkdir(path)
            for name in data:  # shutil's in-kernel copy (sendfile / copy_file_range)
                shutil.copyfile(os.path.join(ckpt, name), os.path.join(path, name))
            fsync_tree(path)
            elapsed = time.perf_counter() - t
        peaks.setdefault("raw copy", []).append(mem.extra)
        return elapsed, elapsed, size_of(path)

    def export_with(label: str, kernel: bool) -> Contender:
        def contender(path: str) -> Timing:
            prepare()
            with PeakAnon() as mem:
                t = time.perf_counter()
                if kernel:
                    sp.export(ckpt, path, hf=True, max_shard_size=args.shard_size)
                else:  # the staging-buffer pipeline, as for a source not stored raw
                    real = _kernel_copy.write
                    _kernel_copy.write = lambda *a, **k: False  # type: ignore[assignment]
                    try:
                        sp.export(ckpt, path, hf=True, max_shard_size=args.shard_size)
                    finally:
                        _kernel_copy.write = real  # type: ignore[assignment]
                elapsed = time.perf_counter() - t
            peaks.setdefault(label, []).append(mem.extra)
            return elapsed, elapsed, size_of(path)

        return contender

    def hub_writer(path: str) -> Timing:
        from huggingface_hub import save_torch_state_dict

        with PeakAnon() as mem:
            t = time.perf_counter()
            os.mkdir(path)
            save_torch_state_dict(tensors, path, max_shard_size=args.shard_size)
            blocking = time.perf_counter() - t
            fsync_tree(path)
            durable = time.perf_counter() - t
        peaks.setdefault("huggingface_hub writer", []).append(mem.extra)
        return blocking, durable, size_of(path)

    def transformers_writer(path: str) -> Timing:
        model = _pretrained(tensors)  # the same tensors as parameters (no copy)
        with PeakAnon() as mem:
            t = time.perf_counter()
            model.save_pretrained(path, max_shard_size=args.shard_size)
            blocking = time.perf_counter() - t
            fsync_tree(path)
            durable = time.perf_counter() - t
        peaks.setdefault("transformers save_pretrained", []).append(mem.extra)
        return blocking, durable, size_of(path)

    dcp_dir = os.path.join(root, "dcp")
    if args.peers:  # the same weights as DCP saved them, for its own consolidation
        import torch.distributed.checkpoint as dcp

        dcp.save({"model": tensors}, checkpoint_id=dcp_dir, no_dist=True)

    def dcp_consolidate(path: str) -> Timing:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        prepare_dir(dcp_dir)
        with PeakAnon() as mem:
            t = time.perf_counter()
            os.mkdir(path)
            dcp_to_torch_save(dcp_dir, os.path.join(path, "model.pt"))
            blocking = time.perf_counter() - t
            fsync_tree(path)
            durable = time.perf_counter() - t
        peaks.setdefault("dcp_to_torch_save", []).append(mem.extra)
        return blocking, durable, size_of(path)

    ours = "sp.export(hf=True)"
    contenders: dict[str, Contender] = {
        "raw copy + fsync": raw_copy,
        ours: export_with(ours, True),
    }
    if args.pipeline:
        contenders["sp.export, staging pipeline"] = export_with("pipeline", False)
    if args.peers:
        contenders["huggingface_hub writer"] = hub_writer
        contenders["transformers save_pretrained"] = transformers_writer
        contenders["dcp_to_torch_save"] = dcp_consolidate
    del state
    results = run(contenders, root, args.repeat)
    cache = "cold (source evicted before each run)" if args.cold else "warm"
    report(
        f"HF sharded export: {nbytes / (1 << 20):.0f} MiB float32, largest tensor "
        f"{largest / (1 << 20):.0f} MiB, shards of {args.shard_size}, source page cache "
        f"{cache}, {args.repeat} rounds, medians (ratio = time)",
        results,
        "raw copy + fsync",
    )
    # Per round: each contender's round against the raw copy of the same round (interleaved).
    copies = [d for _, d, _ in results["raw copy + fsync"]]
    ratios = [c / e for c, (_, e, _) in zip(copies, results[ours])]
    print("  per round, raw copy time / export time: " + ", ".join(f"{r:.2f}" for r in ratios))
    ratio = statistics.median(ratios)
    peak = max(peaks[ours][1:] or peaks[ours])
    print(
        f"  TARGET export throughput >= 0.8 x raw copy throughput: measured "
        f"{ratio:.2f} x (median of rounds) -> {'met' if ratio >= 0.8 else 'NOT met'}"
    )
    print(
        f"  TARGET peak extra memory <= 2 x largest tensor: measured "
        f"{peak / (1 << 20):.1f} MiB anonymous = {peak / largest:.2f} x -> "
        f"{'met' if peak <= 2 * largest else 'NOT met'}"
    )
    for name, label in (
        ("pipeline", "staging pipeline"),
        ("huggingface_hub writer", "huggingface_hub writer (state already in memory)"),
        ("transformers save_pretrained", "transformers save_pretrained (model in memory)"),
        ("dcp_to_torch_save", "dcp_to_torch_save"),
    ):
        if name in peaks:
            top = max(peaks[name][1:] or peaks[name])
            print(
                f"  ({label}: peak extra {top / (1 << 20):.1f} MiB = {top / largest:.2f} x the "
                "largest tensor)"
            )


def sys_version(module: str) -> str:
    import importlib

    return str(getattr(importlib.import_module(module), "__version__", "?"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--only", choices=["accelerate", "transformers", "export"], default=None)
    ap.add_argument(
        "--export-mib", type=int, default=1024, help="checkpoint size for --only export"
    )
    ap.add_argument("--export-gib", type=int, default=0, help="the same in GiB (4: the target)")
    ap.add_argument("--shard-size", default="1GB", help="max_shard_size of the export")
    ap.add_argument(
        "--no-peers",
        dest="peers",
        action="store_false",
        help="export: skip huggingface_hub and dcp_to_torch_save",
    )
    ap.add_argument("--cold", action="store_true", help="export: source out of the page cache")
    ap.add_argument(
        "--pipeline", action="store_true", help="export: also time the staging-buffer path"
    )
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="bench-hf-", dir=args.dir)
    try:
        if args.only in (None, "accelerate"):
            bench_accelerate(args, root)
        if args.only in (None, "transformers"):
            bench_trainer(args, root)
        if args.only in (None, "export"):
            bench_export(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
