"""The parts of a burn record (its metadata, parameters, data), its dtypes and limits, and the
protocols through which the reader and the writer meet the caller's tensors."""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from savepoint.codecs.dtypes import DType

BURN_VERSION = "0.20.1"
MAX_DEPTH = 128
MAX_VALUES = 2_000_000
_RECORDER = "burn_core::record::file::NamedMpkFileRecorder<burn_core::record::settings::FullPrecisionSettings>"
U64 = 1 << 64

# burn's DType spelling <-> savepoint's dtype names. Flex32 is float32 storage.
FROM_BURN = {
    "F64": "F64",
    "F32": "F32",
    "Flex32": "F32",
    "F16": "F16",
    "BF16": "BF16",
    "I64": "I64",
    "I32": "I32",
    "I16": "I16",
    "I8": "I8",
    "U64": "U64",
    "U32": "U32",
    "U16": "U16",
    "U8": "U8",
    "Bool": "BOOL",
}
TO_BURN = {v: k for k, v in FROM_BURN.items() if k != "Flex32"}
DTYPES = tuple(sorted(TO_BURN))  # savepoint's names of the dtypes a burn record holds
FLOATS = frozenset({"F64", "F32", "F16", "BF16"})  # the dtypes Module::num_params counts


@dataclass(frozen=True)
class Metadata:
    """``BurnMetadata``: what wrote the record. burn compares it only to explain a failed load."""

    float_elem: str = "f32"
    int_elem: str = "i32"
    format: str = _RECORDER
    version: str = BURN_VERSION
    settings: str = "FullPrecisionSettings"

    def to_dict(self) -> dict[str, str]:
        return {
            "float": self.float_elem,
            "int": self.int_elem,
            "format": self.format,
            "version": self.version,
            "settings": self.settings,
        }


@dataclass
class Param:
    """A module parameter (burn's ``ParamSerde {id, param}``): a tensor and its id.

    ``value`` is a numpy array, a torch tensor or (from a reader) a lazy tensor; ``id`` None
    means "derive it from the name" when written."""

    value: Any
    id: str | None = None


@dataclass
class Data:
    """A bare ``TensorData`` (no Param around it): rare in module records, kept for fidelity."""

    value: Any


def param_id(name: str) -> str:
    """The id savepoint writes for the parameter ``name``: BLAKE2b (8 bytes) of its UTF-8, as
    burn serializes a ``ParamId`` (BASE32_DNSSEC of the u64's little-endian bytes)."""
    raw = hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return encode_id(raw)


def encode_id(raw8: bytes) -> str:
    """A ``ParamId``'s 8 little-endian bytes as burn serializes them: BASE32_DNSSEC, unpadded."""
    return base64.b32hexencode(raw8).decode("ascii").rstrip("=").lower()


class Tensor(Protocol):
    """What the writer needs of a tensor: the caller streams its bytes."""

    @property
    def dtype(self) -> DType: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...


_S_co = TypeVar("_S_co", bound=Tensor, covariant=True)


class Tensors(Protocol):
    """How :func:`parse` makes the tensors it finds (the caller's lazy tensors)."""

    def stored(
        self,
        view: np.ndarray[Any, Any],
        dtype: DType,
        shape: tuple[int, ...],
        width: int,
        name: str,
    ) -> Any:
        """A tensor whose data is ``view`` (the bin's bytes in the parsed array); ``width``: for
        a boolean one, the bytes per element (1, or 4 for burn 0.21's ``U32`` store)."""
        ...

    def array(self, values: np.ndarray[Any, Any], name: str) -> Any:
        """A burn <= 0.13 tensor, its values decoded (and shaped) in ``values``."""
        ...


class Sources(Protocol[_S_co]):
    """How :func:`layout` finds the tensors of a tree."""

    def source(self, value: Any, where: str) -> _S_co | None:
        """``value`` as a tensor whose bytes the caller streams, or None if it is not one."""
        ...

    def u32_bools(self, value: Any) -> _S_co | None:
        """For a boolean tensor read from burn 0.21's ``U32`` store, its stored bytes as a
        ``U32`` tensor (written back as they were, with a 0.21 metadata); None otherwise."""
        ...
