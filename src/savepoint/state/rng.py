"""``RNGState``: the random number generators of a run, captured and restored as plain data.

A resumed run must draw the same random numbers as the run that never stopped: shuffles,
dropout masks, augmentation. ``RNGState`` is a Stateful that captures every generator you choose
when ``state_dict()`` is called (by ``sp.save``) and puts them back in ``load_state_dict`` (by
``sp.load(path, into=...)``)::

    rng = RNGState(generators={"loader": loader_rng})       # plus python, numpy, torch, cuda
    sp.save(path, {"model": model, "rng": rng})
    ...
    sp.load(path, into={"model": model, "rng": rng})        # the next draws match the saved run

Sources and what is stored (no pickle; arrays are checksummed like any tensor):

=================  ==========================================================================
``python``         ``random.getstate()``: ``{"version": int, "state": uint32[625],
                   "gauss_next": float | None}`` (624 Mersenne Twister words and the position)
``numpy``          the legacy global ``np.random`` state: ``{"bit_generator": "MT19937",
                   "keys": uint32[624], "pos": int, "has_gauss": int, "cached_gaussian": float}``
``torch``          ``torch.get_rng_state()``: a uint8 tensor
``cuda``           ``torch.cuda.get_rng_state_all()``: a list of uint8 tensors, one per device
``generators``     ``{name: {"kind": "numpy", "state": bit_generator.state}}`` for numpy
                   ``Generator``/``BitGenerator``/``RandomState`` objects (the state dict exactly
                   as numpy gives it: arrays, and integers of any size such as PCG64's 128-bit
                   state), or ``{"kind": "torch", "state": uint8 tensor}`` for ``torch.Generator``
=================  ==========================================================================

Defaults: ``python`` and ``numpy`` on; ``torch`` on when torch is already imported at capture
time (savepoint never imports torch for you); ``cuda`` on when torch is imported and
``torch.cuda.is_available()``. Pass True or False to force a source.

``load_state_dict`` checks everything before touching any generator, then restores them all:
either every source is restored or none is. With ``strict=True`` (the default) a source this
object is set to restore but the checkpoint lacks, a generator passed here but not saved (or saved
but not passed), a saved generator of another algorithm, an unknown source, CUDA states on a
machine without CUDA or with another number of devices: each is a problem, all reported in one
RNGStateError. With ``strict=False`` whatever can be restored is (CUDA: the first
``min(saved, present)`` devices), and the rest is listed in ``skipped``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from savepoint.errors import RNGStateError

__all__ = ["RNGState"]

_SOURCES = ("python", "numpy", "torch", "cuda", "generators")
_NUMPY_GENERATORS = (np.random.Generator, np.random.BitGenerator, np.random.RandomState)


def _torch_imported() -> Any:
    return sys.modules.get("torch")


def _is_torch_generator(obj: Any) -> bool:
    torch = _torch_imported()
    return torch is not None and isinstance(obj, torch.Generator)


def _numpy_state(gen: Any) -> dict[str, Any]:
    if isinstance(gen, np.random.Generator):
        return dict(gen.bit_generator.state)
    if isinstance(gen, np.random.BitGenerator):
        return dict(gen.state)
    state = gen.get_state(legacy=False)  # RandomState: includes has_gauss / gauss
    assert isinstance(state, dict)
    return state


def _set_numpy_state(gen: Any, state: dict[str, Any]) -> None:
    if isinstance(gen, np.random.Generator):
        gen.bit_generator.state = state
    elif isinstance(gen, np.random.BitGenerator):
        gen.state = state
    else:
        gen.set_state(state)


def _scratch_numpy(gen: Any) -> Any:
    """A new generator of the same algorithm, to validate a state without touching ``gen``."""
    if isinstance(gen, np.random.Generator):
        return type(gen.bit_generator)()
    if isinstance(gen, np.random.BitGenerator):
        return type(gen)()
    return np.random.RandomState(type(gen._bit_generator)())


def _plain(value: Any) -> Any:
    """Arrays and tensors from a loaded tree as numpy, containers rebuilt, for numpy setters."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    torch = _torch_imported()
    if torch is not None and isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return value


def _byte_tensor(value: Any) -> Any:
    """A CPU uint8 torch tensor from a saved state (torch tensor or numpy array)."""
    import torch

    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 1:
            raise ValueError(f"expected a 1-D uint8 array, got {value.dtype} {list(value.shape)}")
        return torch.from_numpy(np.array(value, copy=True))
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise ValueError(f"expected a 1-D uint8 tensor, got {_describe(value)}")
    return value.detach().to("cpu", copy=True)


def _check_mapping(value: Any) -> None:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping, got {type(value).__name__}")


def _describe(value: Any) -> str:
    dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
    if dtype is not None and shape is not None:
        return f"{type(value).__name__} {dtype} {list(shape)}"
    return type(value).__name__


class RNGState:
    """Captures and restores Python, NumPy, torch, CUDA and user-supplied random generators.

    ``python``, ``numpy``: the global ``random`` and legacy ``np.random`` states (default on).
    ``torch``: the torch CPU generator; None (default) means "if torch is imported when the
    state is captured or restored". ``cuda``: every CUDA device's generator; None means "if torch
    is imported and CUDA is available". ``generators``: named numpy ``Generator``, ``BitGenerator``
    or ``RandomState`` objects and ``torch.Generator`` objects, captured and restored in place.
    ``strict``: see the module docstring; ``load_state_dict(d, strict=...)`` overrides it.

    After each ``load_state_dict``, ``skipped`` lists what was saved but not restored (only ever
    non-empty with ``strict=False``).
    """

    def __init__(
        self,
        *,
        python: bool = True,
        numpy: bool = True,
        torch: bool | None = None,
        cuda: bool | None = None,
        generators: Mapping[str, Any] | None = None,
        strict: bool = True,
    ) -> None:
        self.python = python
        self.numpy = numpy
        self.torch = torch
        self.cuda = cuda
        self.generators: dict[str, Any] = dict(generators or {})
        self.strict = strict
        self.skipped: list[str] = []
        for name, gen in self.generators.items():
            if not isinstance(name, str) or not name:
                raise TypeError(f"generator names must be non-empty str, got {name!r}")
            if not (isinstance(gen, _NUMPY_GENERATORS) or _is_torch_generator(gen)):
                raise TypeError(
                    f"generator {name!r}: {type(gen).__name__} is not a numpy Generator, "
                    "BitGenerator, RandomState or torch.Generator"
                )
        if (torch or cuda) and _torch_imported() is None:
            import torch as _  # noqa: F401  (asked for explicitly: import it now)

    def __repr__(self) -> str:
        on = [s for s in ("python", "numpy", "torch", "cuda") if self._wants(s)]
        return f"RNGState(sources={on}, generators={sorted(self.generators)})"

    def _wants(self, source: str) -> bool:
        flag = getattr(self, source)
        if flag is not None:
            return bool(flag)
        torch = _torch_imported()
        if torch is None:
            return False
        return source == "torch" or bool(torch.cuda.is_available())

    # -- capture ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Capture every chosen generator now, as a tree of plain values and arrays."""
        out: dict[str, Any] = {}
        if self._wants("python"):
            version, words, gauss_next = random.getstate()
            out["python"] = {
                "version": version,
                "state": np.array(words, dtype=np.uint32),
                "gauss_next": gauss_next,
            }
        if self._wants("numpy"):
            name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
            out["numpy"] = {
                "bit_generator": name,
                "keys": np.array(keys, dtype=np.uint32),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if self._wants("torch") or self._wants("cuda"):
            import torch

            if self._wants("torch"):
                out["torch"] = torch.get_rng_state()
            if self._wants("cuda"):
                out["cuda"] = list(torch.cuda.get_rng_state_all())
        if self.generators:
            gens: dict[str, Any] = {}
            for name, gen in self.generators.items():
                if _is_torch_generator(gen):
                    gens[name] = {"kind": "torch", "state": gen.get_state()}
                else:
                    gens[name] = {"kind": "numpy", "state": _numpy_state(gen)}
            out["generators"] = gens
        return out

    # -- restore ------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: Any, strict: bool | None = None) -> None:
        """Restore the generators from a ``state_dict()`` tree (as saved, or as ``sp.load``
        returns it: tensors may come back as torch tensors or numpy arrays).

        Every entry is validated first (on scratch generators where possible); on any problem
        RNGStateError lists them all and no generator has changed. See the module docstring for
        what ``strict`` allows.
        """
        strict = self.strict if strict is None else strict
        problems: list[str] = []
        skipped: list[str] = []
        actions: list[Callable[[], None]] = []
        if not isinstance(state_dict, Mapping):
            raise RNGStateError([f"expected a mapping, got {type(state_dict).__name__}"])

        def problem_unless_lenient(what: str) -> None:
            (problems if strict else skipped).append(what)

        unknown = [k for k in state_dict if k not in _SOURCES]
        for key in unknown:
            problem_unless_lenient(f"unknown source {key!r} in the checkpoint")

        for source, restore in (
            ("python", self._python),
            ("numpy", self._numpy),
            ("torch", self._torch_cpu),
            ("cuda", self._cuda),
        ):
            flag = getattr(self, source)
            if source not in state_dict:
                # Asked for explicitly (python/numpy default on) but not saved.
                if flag:
                    problem_unless_lenient(f"{source}: not in the checkpoint")
                continue
            if flag is False:
                skipped.append(f"{source}: turned off on this RNGState")
                continue
            try:
                actions.append(restore(state_dict[source], strict, skipped))
            except KeyError as exc:
                problems.append(f"{source}: missing key {exc}")
            except ImportError as exc:
                problem_unless_lenient(f"{source}: cannot restore without torch ({exc})")
            except (TypeError, ValueError, RuntimeError) as exc:
                problems.append(f"{source}: {exc}")

        saved = state_dict.get("generators", {})
        if not isinstance(saved, Mapping):
            problems.append(f"generators: expected a mapping, got {type(saved).__name__}")
            saved = {}
        for name in self.generators:
            if name not in saved:
                problem_unless_lenient(f"generator {name!r}: not in the checkpoint")
        for name, entry in saved.items():
            gen = self.generators.get(name)
            if gen is None:
                problem_unless_lenient(f"generator {name!r}: saved but not passed to RNGState")
                continue
            try:
                actions.append(self._generator(name, gen, entry))
            except KeyError as exc:
                problems.append(f"generator {name!r}: missing key {exc}")
            except (TypeError, ValueError, RuntimeError) as exc:
                problems.append(f"generator {name!r}: {exc}")

        if problems:
            raise RNGStateError(problems)
        for act in actions:
            act()
        self.skipped = skipped

    def _python(self, saved: Any, strict: bool, skipped: list[str]) -> Callable[[], None]:
        _check_mapping(saved)
        words = tuple(int(w) for w in np.asarray(_plain(saved["state"])).reshape(-1).tolist())
        gauss = saved["gauss_next"]
        state = (int(saved["version"]), words, None if gauss is None else float(gauss))
        random.Random().setstate(state)  # validates without touching the global generator
        return lambda: random.setstate(state)

    def _numpy(self, saved: Any, strict: bool, skipped: list[str]) -> Callable[[], None]:
        _check_mapping(saved)
        keys = np.asarray(_plain(saved["keys"]))
        if keys.dtype != np.uint32 or keys.shape != (624,):
            raise ValueError(f"keys must be uint32[624], got {keys.dtype} {list(keys.shape)}")
        state = (
            str(saved["bit_generator"]),
            keys,
            int(saved["pos"]),
            int(saved["has_gauss"]),
            float(saved["cached_gaussian"]),
        )
        np.random.RandomState().set_state(state)
        return lambda: np.random.set_state(state)

    def _torch_cpu(self, saved: Any, strict: bool, skipped: list[str]) -> Callable[[], None]:
        import torch

        state = _byte_tensor(saved)
        current = torch.get_rng_state()
        if state.numel() != current.numel():
            raise ValueError(f"{state.numel()} bytes saved, this torch uses {current.numel()}")
        torch.Generator().set_state(state)
        return lambda: torch.set_rng_state(state)

    def _cuda(self, saved: Any, strict: bool, skipped: list[str]) -> Callable[[], None]:
        if not isinstance(saved, (list, tuple)):
            raise TypeError(f"expected a list of device states, got {type(saved).__name__}")
        states = [_byte_tensor(s) for s in saved]
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(states) > available:
            what = (
                f"{len(states)} CUDA device state(s) saved, "
                f"{'CUDA is not available here' if not available else f'{available} device(s) here'}"
            )
            if strict:
                raise RuntimeError(what)
            skipped.append(f"cuda: {what}; restored {min(available, len(states))}")
            states = states[:available]
        if not states:
            return lambda: None
        current = torch.cuda.get_rng_state_all()
        for i, (s, c) in enumerate(zip(states, current)):
            if s.numel() != c.numel():
                raise ValueError(f"device {i}: {s.numel()} bytes saved, {c.numel()} here")
        if len(states) < available:
            what = f"{len(states)} CUDA device state(s) saved, {available} device(s) here"
            if strict:
                raise RuntimeError(what + "; the others would keep their current state")
            skipped.append(f"cuda: {what}; devices {len(states)}.. keep their state")

        def restore() -> None:
            for i, s in enumerate(states):
                torch.cuda.set_rng_state(s, i)

        return restore

    def _generator(self, name: str, gen: Any, entry: Any) -> Callable[[], None]:
        if not isinstance(entry, Mapping) or "kind" not in entry or "state" not in entry:
            raise ValueError("expected {'kind': ..., 'state': ...}")
        kind = entry["kind"]
        if _is_torch_generator(gen):
            if kind != "torch":
                raise ValueError(f"a {kind} generator state was saved, a torch.Generator is here")
            state = _byte_tensor(entry["state"])
            current = gen.get_state()
            if state.numel() != current.numel():
                raise ValueError(
                    f"{state.numel()} bytes saved, this {gen.device} generator uses "
                    f"{current.numel()}"
                )
            return lambda: gen.set_state(state)
        if kind != "numpy":
            raise ValueError(f"a {kind} generator state was saved, a numpy generator is here")
        state = _plain(entry["state"])
        if not isinstance(state, dict):
            raise ValueError(f"expected a bit_generator state dict, got {type(state).__name__}")
        algorithm = _numpy_state(gen).get("bit_generator")
        if state.get("bit_generator") != algorithm:
            raise ValueError(
                f"a {state.get('bit_generator')} state was saved, the generator here is {algorithm}"
            )
        _set_numpy_state(_scratch_numpy(gen), state)
        return lambda: _set_numpy_state(gen, state)
