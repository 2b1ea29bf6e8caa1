"""RNGState: every source's next draws after a restore equal the draws after the save point."""

from __future__ import annotations

import pickle
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import savepoint as sp
from savepoint.errors import RNGStateError
from savepoint.state.rng import RNGState


def _python_draws() -> list[Any]:
    return [random.random(), random.gauss(0, 1), random.getrandbits(70)]


def _numpy_draws() -> list[Any]:
    return [*np.random.random(3).tolist(), float(np.random.standard_normal())]


def _torch() -> Any:
    return pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _keep_global_rngs() -> Any:
    """Tests reseed global generators; leave them as they were for the rest of the suite."""
    py, npy = random.getstate(), np.random.get_state()
    yield
    random.setstate(py)
    np.random.set_state(npy)


@pytest.mark.parametrize("how", ["tree", "into"])
def test_python_and_numpy_resume(ckpt: Path, how: str) -> None:
    random.seed(1)
    np.random.seed(2)
    random.gauss(0, 1)  # leaves a cached gauss_next in the Python state
    np.random.standard_normal()  # and a cached gaussian in numpy's
    rng = RNGState(torch=False, cuda=False)
    sp.save(ckpt, {"rng": rng})
    expected = (_python_draws(), _numpy_draws())
    # advance everything further, then restore
    _python_draws()
    _numpy_draws()
    if how == "tree":
        RNGState(torch=False, cuda=False).load_state_dict(sp.load(ckpt)["rng"])
    else:
        sp.load(ckpt, into={"rng": RNGState(torch=False, cuda=False)})
    assert (_python_draws(), _numpy_draws()) == expected


def test_state_dict_is_plain_data() -> None:
    d = RNGState(torch=False, cuda=False).state_dict()
    assert set(d) == {"python", "numpy"}
    assert d["python"]["state"].dtype == np.uint32 and d["python"]["state"].shape == (625,)
    assert d["numpy"]["keys"].dtype == np.uint32 and d["numpy"]["keys"].shape == (624,)
    assert d["numpy"]["bit_generator"] == "MT19937"
    assert isinstance(d["numpy"]["pos"], int) and isinstance(d["numpy"]["cached_gaussian"], float)


@pytest.mark.parametrize("algorithm", ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"])
@pytest.mark.parametrize("how", ["tree", "into"])
def test_numpy_generators_resume(ckpt: Path, algorithm: str, how: str) -> None:
    gen = np.random.Generator(getattr(np.random, algorithm)(42))
    bitgen = np.random.PCG64(7)
    legacy = np.random.RandomState(3)
    gen.random(5)
    gen.integers(0, 2**32, dtype=np.uint32)  # a half-used 64-bit word (has_uint32)
    legacy.standard_normal()  # a cached gaussian
    gens = {"loader": gen, "raw": bitgen, "legacy": legacy}
    sp.save(ckpt, {"rng": RNGState(python=False, numpy=False, torch=False, generators=gens)})

    def draws() -> list[Any]:
        return [
            *gen.random(3).tolist(),
            int(gen.integers(0, 2**32, dtype=np.uint32)),
            int(bitgen.random_raw()),
            float(legacy.standard_normal()),
            float(legacy.random()),
        ]

    expected = draws()
    draws()
    fresh = RNGState(python=False, numpy=False, torch=False, generators=gens)
    if how == "tree":
        saved = sp.load(ckpt)["rng"]
        if algorithm == "PCG64":  # 128-bit integers survive the manifest exactly
            assert saved["generators"]["loader"]["state"]["state"]["state"] > 2**64
        fresh.load_state_dict(saved)
    else:
        sp.load(ckpt, into={"rng": fresh})
    assert draws() == expected


def test_generator_of_another_algorithm_is_refused_and_nothing_changes(ckpt: Path) -> None:
    sp.save(ckpt, RNGState(torch=False, generators={"g": np.random.default_rng(0)}))
    random.seed(5)
    before = random.getstate()
    other = RNGState(torch=False, generators={"g": np.random.Generator(np.random.MT19937(0))})
    with pytest.raises(
        RNGStateError, match="a PCG64 state was saved, the generator here is MT19937"
    ):
        other.load_state_dict(sp.load(ckpt))
    assert random.getstate() == before  # the python state was valid but not restored either


def test_strict_checks_generators_and_sources(ckpt: Path) -> None:
    sp.save(ckpt, RNGState(numpy=False, torch=False, generators={"a": np.random.default_rng()}))
    target = RNGState(torch=False, generators={"b": np.random.default_rng()})
    with pytest.raises(RNGStateError) as excinfo:
        target.load_state_dict(sp.load(ckpt))
    problems = excinfo.value.problems
    assert "numpy: not in the checkpoint" in problems
    assert "generator 'b': not in the checkpoint" in problems
    assert "generator 'a': saved but not passed to RNGState" in problems
    assert isinstance(excinfo.value, sp.IncompatibleCheckpointError)
    assert "strict=False" in str(excinfo.value)

    random.seed(9)
    expected = _python_draws()
    random.seed(9)
    sp.save(ckpt, RNGState(numpy=False, torch=False, generators={"a": np.random.default_rng()}))
    loose = RNGState(torch=False, generators={"b": np.random.default_rng()}, strict=False)
    sp.load(ckpt, into=loose)
    assert _python_draws() == expected
    assert len(loose.skipped) == 3


def test_turned_off_source_is_not_restored(ckpt: Path) -> None:
    np.random.seed(0)
    sp.save(ckpt, RNGState(torch=False))
    np.random.seed(1)
    expected = _numpy_draws()
    np.random.seed(1)
    rng = RNGState(numpy=False, torch=False)
    rng.load_state_dict(sp.load(ckpt))
    assert _numpy_draws() == expected
    assert rng.skipped == ["numpy: turned off on this RNGState"]


@pytest.mark.parametrize(
    "bad",
    [
        {"python": {"version": 3, "state": np.zeros(10, np.uint32), "gauss_next": None}},
        {"python": {"version": 3}},
        {"numpy": {"bit_generator": "MT19937", "keys": np.zeros(3, np.uint32), "pos": 0,
                   "has_gauss": 0, "cached_gaussian": 0.0}},
        {"python": "nonsense"},
        {"generators": [1, 2]},
        "not a mapping",
    ],
)  # fmt: skip
def test_malformed_states_are_refused(bad: Any) -> None:
    random.seed(3)
    before = random.getstate()
    # strict=False: a missing source is fine, a malformed one never is.
    with pytest.raises(RNGStateError) as excinfo:
        RNGState(torch=False, strict=False).load_state_dict(bad)
    assert len(excinfo.value.problems) == 1
    assert random.getstate() == before


def test_unknown_source_is_a_problem_unless_not_strict() -> None:
    saved = {**RNGState(torch=False).state_dict(), "jax": {"key": [1, 2]}}
    with pytest.raises(RNGStateError, match="unknown source 'jax'"):
        RNGState(torch=False).load_state_dict(saved)
    loose = RNGState(torch=False)
    loose.load_state_dict(saved, strict=False)
    assert loose.skipped == ["unknown source 'jax' in the checkpoint"]


def test_generators_must_be_generators() -> None:
    with pytest.raises(TypeError, match="not a numpy Generator"):
        RNGState(generators={"x": random.Random()})


def test_error_survives_pickle() -> None:
    with pytest.raises(RNGStateError) as excinfo:
        RNGState(torch=False).load_state_dict({})
    copy = pickle.loads(pickle.dumps(excinfo.value))
    assert copy.problems == excinfo.value.problems and str(copy) == str(excinfo.value)


# ---------------------------------------------------------------------------------------------
# torch
# ---------------------------------------------------------------------------------------------


def _torch_draws(gen: Any = None) -> list[float]:
    t = _torch()
    return t.rand(4, generator=gen).tolist()


@pytest.mark.torch
@pytest.mark.parametrize("how", ["tree", "into"])
def test_torch_cpu_and_torch_generators_resume(ckpt: Path, how: str) -> None:
    t = _torch()
    t.manual_seed(11)
    gen = t.Generator().manual_seed(12)
    _torch_draws()
    _torch_draws(gen)
    rng = RNGState(generators={"dropout": gen})  # torch is imported: captured by default
    state = rng.state_dict()
    assert isinstance(state["torch"], t.Tensor) and state["torch"].dtype == t.uint8
    sp.save(ckpt, {"rng": rng})
    expected = (_torch_draws(), _torch_draws(gen), _python_draws(), _numpy_draws())
    _torch_draws()
    _torch_draws(gen)
    fresh = RNGState(generators={"dropout": gen})
    if how == "tree":
        fresh.load_state_dict(sp.load(ckpt)["rng"])
    else:
        sp.load(ckpt, into={"rng": fresh})
    assert (_torch_draws(), _torch_draws(gen), _python_draws(), _numpy_draws()) == expected


@pytest.mark.torch
def test_torch_state_loaded_as_numpy_still_restores(ckpt: Path) -> None:
    t = _torch()
    t.manual_seed(5)
    sp.save(ckpt, RNGState(python=False, numpy=False))
    expected = _torch_draws()
    tree = sp.load(ckpt, framework="numpy")
    assert isinstance(tree["torch"], np.ndarray)
    RNGState(python=False, numpy=False).load_state_dict(tree)
    assert _torch_draws() == expected


@pytest.mark.torch
def test_torch_generator_state_must_match() -> None:
    t = _torch()
    gen = t.Generator()
    rng = RNGState(python=False, numpy=False, torch=False, generators={"g": gen})
    bad = {"generators": {"g": {"kind": "numpy", "state": {}}}}
    with pytest.raises(RNGStateError, match="a numpy generator state was saved, a torch"):
        rng.load_state_dict(bad)
    short = {"generators": {"g": {"kind": "torch", "state": t.zeros(3, dtype=t.uint8)}}}
    with pytest.raises(RNGStateError, match="3 bytes saved"):
        rng.load_state_dict(short)
    wrong = {"torch": t.zeros(5056, dtype=t.int32)}
    with pytest.raises(RNGStateError, match="uint8"):
        RNGState(python=False, numpy=False).load_state_dict(wrong)


@pytest.mark.torch
def test_cuda_state_without_cuda_needs_strict_false() -> None:
    t = _torch()
    if t.cuda.is_available():
        pytest.skip("this machine has CUDA")
    fake_cuda = [t.zeros(16, dtype=t.uint8), t.zeros(16, dtype=t.uint8)]
    saved = {**RNGState(python=False, numpy=False).state_dict(), "cuda": fake_cuda}
    t.manual_seed(3)
    before = t.get_rng_state()
    with pytest.raises(
        RNGStateError, match=r"2 CUDA device state\(s\) saved, CUDA is not available"
    ):
        RNGState(python=False, numpy=False).load_state_dict(saved)
    assert t.equal(t.get_rng_state(), before)  # nothing restored
    loose = RNGState(python=False, numpy=False, strict=False)
    loose.load_state_dict(saved)
    assert loose.skipped and "CUDA is not available" in loose.skipped[0]
    assert "cuda" not in RNGState().state_dict()  # not captured where there is no CUDA


@pytest.mark.torch
@pytest.mark.cuda
def test_cuda_resume_on_a_cuda_machine(ckpt: Path) -> None:
    t = _torch()
    if not t.cuda.is_available():
        pytest.skip("needs CUDA")
    t.cuda.manual_seed_all(21)
    rng = RNGState()
    assert len(rng.state_dict()["cuda"]) == t.cuda.device_count()
    sp.save(ckpt, {"rng": rng})
    expected = t.rand(4, device="cuda").tolist()
    t.rand(4, device="cuda")
    sp.load(ckpt, into={"rng": RNGState()})
    assert t.rand(4, device="cuda").tolist() == expected


@pytest.mark.torch
def test_torch_state_on_a_machine_without_torch(ckpt: Path) -> None:
    _torch()
    sp.save(ckpt, RNGState(torch=True))
    code = f"""
import sys
sys.modules["torch"] = None  # as if torch were not installed
import savepoint as sp
from savepoint.errors import RNGStateError
from savepoint.state.rng import RNGState
tree = sp.load({str(ckpt)!r}, framework="numpy")
try:
    RNGState().load_state_dict(tree)
except RNGStateError as exc:
    assert "torch: cannot restore without torch" in str(exc), str(exc)
else:
    raise SystemExit("no error")
rng = RNGState(strict=False)
rng.load_state_dict(tree)
assert len(rng.skipped) == 1 and rng.skipped[0].startswith("torch:"), rng.skipped
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.torch
def test_cuda_device_counts_with_a_simulated_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA bookkeeping, on any machine: torch.cuda replaced by two fake devices."""
    t = _torch()
    devices = {0: t.full((16,), 1, dtype=t.uint8), 1: t.full((16,), 2, dtype=t.uint8)}
    monkeypatch.setattr(t.cuda, "is_available", lambda: True)
    monkeypatch.setattr(t.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(t.cuda, "get_rng_state_all", lambda: [devices[i].clone() for i in devices])

    def set_state(state: Any, device: int) -> None:
        devices[device] = state.clone()

    monkeypatch.setattr(t.cuda, "set_rng_state", set_state)
    saved = RNGState(python=False, numpy=False, torch=False).state_dict()
    assert [s[0].item() for s in saved["cuda"]] == [1, 2]  # cuda=None: on when available

    devices[0], devices[1] = t.zeros(16, dtype=t.uint8), t.zeros(16, dtype=t.uint8)
    RNGState(python=False, numpy=False, torch=False).load_state_dict(saved)
    assert (devices[0][0].item(), devices[1][0].item()) == (1, 2)

    one = {"cuda": saved["cuda"][:1]}
    with pytest.raises(RNGStateError, match=r"1 CUDA device state\(s\) saved, 2 device\(s\) here"):
        RNGState(python=False, numpy=False, torch=False).load_state_dict(one)
    three = {"cuda": [*saved["cuda"], saved["cuda"][0]]}
    with pytest.raises(RNGStateError, match=r"3 CUDA device state\(s\) saved, 2 device\(s\) here"):
        RNGState(python=False, numpy=False, torch=False).load_state_dict(three)
    devices[0], devices[1] = t.zeros(16, dtype=t.uint8), t.zeros(16, dtype=t.uint8)
    loose = RNGState(python=False, numpy=False, torch=False, strict=False)
    loose.load_state_dict(three)
    assert (devices[0][0].item(), devices[1][0].item()) == (1, 2)
    assert loose.skipped == ["cuda: 3 CUDA device state(s) saved, 2 device(s) here; restored 2"]
    off = RNGState(python=False, numpy=False, torch=False, cuda=False)
    assert "cuda" not in off.state_dict()
