"""The checks behind the CUDA tests, written once for any device.

``tests/cuda/test_cuda_*.py`` run them on ``"cuda"`` (marked ``cuda``, skipped without a GPU);
``tests/cuda/test_twins_on_cpu.py`` runs the same functions on ``"cpu"`` in every CPU run of the
suite, so a mistake in a check fails here, not on the GPU machine that is lent for minutes. Only
the CUDA-specific parts (stream ordering, pinned memory, device memory statistics) are guarded by
``is_cuda``. Not collected (no ``test_`` prefix).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import savepoint as sp  # noqa: E402
from savepoint.codecs import dtypes  # noqa: E402

MiB = 1 << 20

# Every dtype savepoint stores (bool, the integer widths, float16/bfloat16/32/64, complex64 and
# the four float8 formats), by torch name.
DTYPE_NAMES = [d.torch_name for d in dtypes._TABLE]


def device_of(device: str) -> Any:
    """``torch.device(device)`` with the index filled in (``cuda`` -> ``cuda:0``) as tensors
    report it."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def is_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def synchronize(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def random_tensor(dtype: Any, shape: tuple[int, ...], gen: Any, device: str) -> Any:
    """Random bytes of ``dtype`` (every bit pattern, NaNs included; bool: 0 or 1) made on the
    host and moved to ``device`` (a plain copy, which every dtype supports on CUDA)."""
    n = 1
    for s in shape:
        n *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    t = (raw & 1).bool() if dtype == torch.bool else raw.view(dtype)
    return t.reshape(shape).to(device)


def zoo(device: str, seed: int) -> dict[str, Any]:
    """Every stored dtype, contiguous and as two non-contiguous views (a transpose, and a strided
    slice with a storage offset), plus a 0-d and an empty tensor. The same structure for every
    seed, different bytes: ``zoo(d, 2)`` is a target ``sp.load(into=)`` must overwrite with
    ``zoo(d, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name in DTYPE_NAMES:
        dt = getattr(torch, name)
        out[name] = random_tensor(dt, (24, 40), gen, device)
        out[f"{name}.T"] = random_tensor(dt, (16, 12), gen, device).t()
        out[f"{name}.strided"] = random_tensor(dt, (10, 30), gen, device)[2:, 3::4]
    out["scalar"] = random_tensor(torch.float32, (), gen, device)
    out["empty"] = random_tensor(torch.bfloat16, (0, 7), gen, device)
    return out


def host_bytes(t: Any) -> bytes:
    """A tensor's elements as bytes, in row-major order, wherever it lives."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return bytes(flat.view(torch.uint8).numpy())


def assert_same(got: Any, want: Any, where: str, device: str | None = None) -> None:
    """Same dtype, shape and bytes (and, given ``device``, on that device)."""
    assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, not a tensor"
    assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{where}: shape {got.shape} != {want.shape}"
    if device is not None:
        assert got.device == device_of(device), f"{where}: on {got.device}, not {device}"
    assert host_bytes(got) == host_bytes(want), f"{where}: bytes differ"


# -- save and load of every dtype, views and tied tensors --------------------------------------


def check_roundtrip(path: Path, device: str) -> None:
    """``sp.save`` of the zoo on ``device`` (with two tied entries), then: ``sp.load(into=)``
    fills targets on the device in place; ``sp.load(device=)`` returns every tensor on the
    device, tied entries as one tensor; a plain load returns the same bytes on the host."""
    state = zoo(device, seed=1)
    tied = random_tensor(torch.float32, (64, 32), torch.Generator().manual_seed(3), device)
    state["tied_a"] = tied
    state["tied_b"] = tied
    sp.save(path, state)
    info = sp.inspect(path)
    refs = {t.key: t.ref for t in info.tensors}
    assert refs["tied_a"] == refs["tied_b"], "tied tensors stored twice"

    targets = zoo(device, seed=2)
    other = random_tensor(torch.float32, (64, 32), torch.Generator().manual_seed(4), device)
    targets["tied_a"] = other
    targets["tied_b"] = other
    before = {k: (id(v), v.data_ptr(), v.stride()) for k, v in targets.items()}
    assert sp.load(path, into=targets) is targets
    synchronize(device)
    for key, want in state.items():
        got = targets[key]
        assert (id(got), got.data_ptr(), got.stride()) == before[key], f"{key}: not in place"
        assert_same(got, want, key, device)
    assert targets["tied_a"] is targets["tied_b"]

    loaded = sp.load(path, device=device)
    for key, want in state.items():
        assert_same(loaded[key], want, key, device)
        assert loaded[key].is_contiguous()
    assert loaded["tied_a"] is loaded["tied_b"], "tied tensors came back as two"

    host = sp.load(path)
    for key, want in state.items():
        assert_same(host[key], want, key, "cpu")


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 96, bias=False)
        self.head.weight = self.embed.weight


def check_tied_module(path: Path, device: str) -> None:
    """A module with tied weights on the device: saved once, restored into another such module
    in place and still tied, and loaded with ``device=`` as one tensor."""
    torch.manual_seed(5)
    model = TiedLM().to(device).to(torch.bfloat16)
    sp.save(path, {"model": model})
    info = sp.inspect(path)
    tied = [t for t in info.tensors if t.key in ("model/embed.weight", "model/head.weight")]
    assert len({t.ref for t in tied}) == 1, tied

    torch.manual_seed(6)
    other = TiedLM().to(device).to(torch.bfloat16)
    weight = other.embed.weight
    sp.load(path, into={"model": other})
    synchronize(device)
    assert other.embed.weight is weight and other.head.weight is weight, "no longer tied"
    for name, value in model.state_dict().items():
        assert_same(other.state_dict()[name], value, name, device)

    loaded = sp.load(path, device=device)["model"]
    assert loaded["embed.weight"] is loaded["head.weight"]
    assert_same(loaded["embed.weight"], model.embed.weight, "embed.weight", device)


def check_corrupt_device_load(path: Path, device: str, flip_byte: Any) -> None:
    """A flipped byte is found by device loads too: ``device=`` and ``into=`` device targets
    raise CorruptCheckpointError naming the tensor."""
    gen = torch.Generator().manual_seed(7)
    state = {"w": random_tensor(torch.float32, (512, 256), gen, device)}
    sp.save(path, state)
    flip_byte(path, "w", 4097)
    with pytest.raises(sp.CorruptCheckpointError, match="'w'"):
        sp.load(path, device=device)
    with pytest.raises(sp.CorruptCheckpointError, match="'w'"):
        sp.load(path, into={"w": torch.zeros_like(state["w"])})


def check_save_orders_after_the_current_stream(path: Path, device: str) -> None:
    """``sp.save`` called inside ``torch.cuda.stream(s)`` saves what the work queued on ``s``
    wrote, also when the save writes several files from several threads (each thread's own
    current stream is the default stream, not ``s``). On the CPU: the same save, trivially."""
    gen = torch.Generator().manual_seed(8)
    state = {f"t{i}": random_tensor(torch.float32, (1024, 1024), gen, device) for i in range(6)}
    if is_cuda(device):
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the fills below come later
            for i, t in enumerate(state.values()):
                t.fill_(float(i + 1))
            sp.save(path, state, max_file_bytes=4 * MiB, writers=4)
        torch.cuda.synchronize()
    else:
        for i, t in enumerate(state.values()):
            t.fill_(float(i + 1))
        sp.save(path, state, max_file_bytes=4 * MiB, writers=4)
    assert len(sp.inspect(path).files) >= 3
    loaded = sp.load(path)
    for i, key in enumerate(state):
        assert bool((loaded[key] == float(i + 1)).all()), f"{key}: saved before the fill ran"


def big_zoo(device: str, seed: int, piece: int) -> dict[str, Any]:
    """Every stored dtype at just over 1 MiB (the size from which async saves hash a CUDA
    tensor on its device), and a uint8 tensor of two ``piece``s and an odd remainder (the
    device load path reads and checks it piece by piece)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    for name in DTYPE_NAMES:
        dt = getattr(torch, name)
        itemsize = torch.empty((), dtype=dt).element_size()
        out[name] = random_tensor(dt, (MiB // itemsize + 3,), gen, device)
    out["multi"] = random_tensor(torch.uint8, (2 * piece + 12345,), gen, device)
    return out


def check_device_paths_every_dtype(tmp: Path, device: str, flip_byte: Any) -> None:
    """Loads onto the device (``savepoint.engine.device``: pinned pieces, checks on the device
    or from the pinned piece) of every dtype, from a sync save (XXH3, checked on the host) and an
    async save (``mlh64``, hashed on the device while staged, checked on the device when
    loaded), and a flipped byte in the last piece of a tensor found on the device."""
    import json

    from savepoint.engine import device as fill

    state = big_zoo(device, 12, fill.PIECE)
    direct = len(state) - 1  # every tensor but the bool one takes the device path

    def loads(path: Path, checked: str) -> None:
        out = sp.load(path, device=device)
        assert fill.stats[checked] == direct, dict(fill.stats)
        for key, want in state.items():
            assert_same(out[key], want, key, device)
        targets = {k: torch.zeros_like(v) for k, v in state.items()}
        sp.load(path, into=targets)
        synchronize(device)
        assert fill.stats[checked] == direct, dict(fill.stats)
        for key, want in state.items():
            assert_same(targets[key], want, key, device)

    sp.save(tmp / "sync", state)
    loads(tmp / "sync", "host_checked")

    with sp.AsyncCheckpointer() as ck:
        ck.save(tmp / "async", state)
    doc = json.loads((tmp / "async" / "manifest.json").read_bytes())
    assert doc["format_version"] == 6
    assert all("mlh64" in doc["tensors"][key] for key in state), "not hashed on the device"
    loads(tmp / "async", "device_checked")
    host = sp.load(tmp / "async")  # mlh64 checked by NumPy on the host
    for key, want in state.items():
        assert_same(host[key], want, key, "cpu")
    sp.verify(tmp / "async")

    flip_byte(tmp / "async", "multi", 2 * fill.PIECE + 100)
    with pytest.raises(sp.CorruptCheckpointError, match="'multi'"):
        sp.load(tmp / "async", device=device)
    with pytest.raises(sp.CorruptCheckpointError, match="'multi'"):
        sp.load(tmp / "async", into={"multi": torch.zeros_like(state["multi"])})


# -- async saves ---------------------------------------------------------------------------------


def _hammer(state: dict[str, Any], rounds: int) -> None:
    """In-place updates of every tensor, queued (on CUDA, without waiting) on the current
    stream."""
    for _ in range(rounds):
        state["f32"].add_(1.0)
        state["bf16"].mul_(-1.0)
        state["i64"].bitwise_xor_(0x5555)
        state["view"].sub_(3.0)  # a transposed view into f32_base


def async_state(device: str, mib: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(9)
    n = mib * MiB // 4
    base = torch.randn(n // 1024, 1024, generator=gen).to(device)
    return {
        "f32": torch.randn(n, generator=gen).to(device),
        "bf16": torch.randn(n, generator=gen).to(torch.bfloat16).to(device),
        "i64": torch.randint(0, 1 << 40, (n // 2,), generator=gen).to(device),
        "view": base.t(),
        "step": 0,
    }


def check_async_captures_state_at_return(
    tmp: Path, device: str, *, saves: int, rounds: int, mib: int, writer: str = "thread"
) -> None:
    """Each ``AsyncCheckpointer.save()`` writes the state as it was when ``save()`` returned,
    although ``rounds`` in-place updates of every tensor are queued on the current stream right
    after it. On CUDA a long kernel queued just before ``save()`` holds the side stream's copies
    back, so updates that did not wait for the copies would overtake them. ``writer``: the
    checkpointer's (``"process"``: the staging arena is shared memory registered with CUDA)."""
    state = async_state(device, mib)
    expected = []
    with sp.AsyncCheckpointer(writer=writer) as ck:
        for i in range(saves):
            state["step"] = i
            if is_cuda(device):
                torch.cuda._sleep(100_000_000)  # the copies queue up behind ~50 ms of GPU time
            # Queued before save(): the state save() must capture.
            expected.append({k: v.clone() if hasattr(v, "clone") else v for k, v in state.items()})
            pending = ck.save(tmp / f"s{i}", state)
            _hammer(state, rounds)
            pending.wait()
    for i, want in enumerate(expected):
        got = sp.load(tmp / f"s{i}")
        assert got["step"] == i
        for key in ("f32", "bf16", "i64", "view"):
            assert_same(got[key], want[key], f"save {i}: {key}", "cpu")


def check_async_survives_freed_tensors(
    tmp: Path, device: str, *, mib: int, writer: str = "thread"
) -> None:
    """The state's tensors are dropped right after ``save()`` and new tensors of the same sizes
    filled on the same stream (the caching allocator would hand them the same blocks, were the
    staging copies not ordered before them): the save still writes the dropped tensors'
    values."""
    state = async_state(device, mib)
    expected = {k: host_bytes(v) for k, v in state.items() if k != "step"}
    with sp.AsyncCheckpointer(writer=writer) as ck:
        if is_cuda(device):
            torch.cuda._sleep(100_000_000)
        pending = ck.save(tmp / "freed", state)
        shapes = [(v.shape, v.dtype) for k, v in state.items() if k != "step"]
        del state
        gc.collect()
        junk = [torch.full(s, 7, dtype=d, device=device) for s, d in shapes]
        pending.wait()
    del junk
    got = sp.load(tmp / "freed")
    for key, want in expected.items():
        assert host_bytes(got[key]) == want, f"{key}: overwritten before it was staged"


def anon_rss() -> int:
    """This process's resident anonymous and shared memory, in bytes (file-backed pages, such
    as mapped checkpoint files that the kernel can drop, are left out)."""
    fields: dict[str, int] = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("RssAnon", "RssShmem", "VmRSS"):
                fields[name] = int(value.split()[0]) * 1024
    if "RssAnon" in fields:
        return fields["RssAnon"] + fields.get("RssShmem", 0)
    return fields["VmRSS"]


def host_pinned_bytes() -> int | None:
    """Bytes held by torch's pinned host allocator (None where torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    try:
        s = stats()
    except (RuntimeError, AssertionError):
        return None
    for key in ("allocated_bytes.current", "reserved_bytes.current"):
        if key in s:
            return int(s[key])
    return None


def check_arena_reused(tmp: Path, device: str, *, saves: int, mib: int) -> None:
    """One staging arena for ``saves`` async saves of a state of constant size: allocated at
    the first save (pinned for a CUDA state), the very same object afterwards, and neither host
    memory nor device memory grows from the 10th save to the last."""
    state = async_state(device, mib)
    seen: dict[str, Any] = {}
    with sp.AsyncCheckpointer() as ck:
        for i in range(saves):
            state["step"] = i
            state["f32"].add_(1.0)
            ck.save(tmp / ("a" if i % 2 else "b"), state).wait()
            arena = ck._arena
            if i == 0:
                seen["keep"], seen["capacity"] = arena._keep, arena.capacity
                assert arena.pinned == is_cuda(device)
                if is_cuda(device):
                    assert arena._keep.is_pinned()
            assert arena._keep is seen["keep"], f"save {i}: a new arena was allocated"
            assert arena.capacity == seen["capacity"]
            if i == 9:
                gc.collect()
                seen["rss"] = anon_rss()
                if is_cuda(device):
                    seen["device"] = torch.cuda.memory_allocated()
                    seen["pinned"] = host_pinned_bytes()
        gc.collect()
        grown = anon_rss() - seen["rss"]
        assert grown < 48 * MiB, f"host memory grew by {grown / MiB:.0f} MiB over {saves} saves"
        if is_cuda(device):  # a leak would grow by at least the 4 MiB view's copy a save
            grown = torch.cuda.memory_allocated() - seen["device"]
            assert grown <= 2 * MiB, f"device memory grew by {grown / MiB:.1f} MiB"
            if seen["pinned"] is not None:
                grown = (host_pinned_bytes() or 0) - seen["pinned"]
                assert grown <= 2 * MiB, f"pinned host memory grew by {grown / MiB:.1f} MiB"
    got = sp.load(tmp / ("a" if (saves - 1) % 2 else "b"))
    assert got["step"] == saves - 1
    assert_same(got["f32"], state["f32"], "f32", "cpu")


# -- device loads and host memory ----------------------------------------------------------------


@contextmanager
def peak_growth(every: float = 0.001) -> Iterator[dict[str, int]]:
    """Samples :func:`anon_rss` every ``every`` seconds while the block runs; the yielded dict
    gets ``growth``: the peak over the value at entry, in bytes."""
    gc.collect()
    start = anon_rss()
    box = {"peak": start}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            box["peak"] = max(box["peak"], anon_rss())
            time.sleep(every)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out: dict[str, int] = {}
    try:
        yield out
    finally:
        stop.set()
        t.join()
        box["peak"] = max(box["peak"], anon_rss())
        out["growth"] = box["peak"] - start


def check_device_load_memory(path: Path, device: str, *, mib: int) -> None:
    """A ``device=`` load and an ``into=`` load of a ``mib`` MiB state: every tensor lands on the
    device; the host holds at most one copy of the state at a time (peak resident anonymous
    memory grows by under 1.5x the state), and the device holds no second copy (its peak
    allocation grows by the state's size for ``device=``, by almost nothing for ``into=``)."""
    gen = torch.Generator().manual_seed(10)
    n = 8
    state = {
        f"w{i}": random_tensor(torch.float32, (mib * MiB // n // 4,), gen, device) for i in range(n)
    }
    nbytes = sum(t.nbytes for t in state.values())
    sp.save(path, state)
    sp.load(path, keys="w0", device=device)  # imports and first-use costs out of the figures
    targets = {k: torch.zeros_like(v) for k, v in state.items()}  # touched: no first-touch faults
    slack = 32 * MiB

    if is_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with peak_growth() as host:
        loaded = sp.load(path, device=device)
        synchronize(device)
    assert host["growth"] <= 1.5 * nbytes + slack, (
        f"device= load: host memory grew by {host['growth'] / MiB:.0f} MiB for a "
        f"{nbytes / MiB:.0f} MiB state"
    )
    if is_cuda(device):
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= nbytes + 16 * MiB, f"device= load: {peak / MiB:.0f} MiB on the device"
    for key, want in state.items():
        assert_same(loaded[key], want, key, device)
    del loaded
    gc.collect()

    if is_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with peak_growth() as host:
        sp.load(path, into=targets)
        synchronize(device)
    assert host["growth"] <= 1.5 * nbytes + slack, (
        f"into= load: host memory grew by {host['growth'] / MiB:.0f} MiB for a "
        f"{nbytes / MiB:.0f} MiB state"
    )
    if is_cuda(device):
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 16 * MiB, f"into= load: {peak / MiB:.0f} MiB more on the device"
    for key, want in state.items():
        assert_same(targets[key], want, key, device)


# -- subprocess scripts ----------------------------------------------------------------------------

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def child_env() -> dict[str, str]:
    """The environment for a child Python running savepoint from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS (the resume test)
    return env
