"""The blob store's reads: one blob whole or by range, checked against its name or its XXH3-64
(:class:`Reads`), and the content a recipe describes, its chunks and its patches
(:class:`RecipeReads`); mixins of :class:`savepoint.blobs.store.BlobStore` (see ``store.py``'s
docstring)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

import numpy as np

from savepoint.blobs import frame
from savepoint.blobs._base import BlobBase, BlobInfo, empty, out_array
from savepoint.blobs.frame import HEADER
from savepoint.codecs import checksum as _checksum
from savepoint.codecs.recipe import Patch, Recipe
from savepoint.errors import CorruptCheckpointError, IncompatibleCheckpointError

__all__ = ["RecipeReads", "Reads"]


class Reads(BlobBase):
    """Reading and checking one blob (see :class:`savepoint.blobs.store.BlobStore`)."""

    def _read_payload(
        self, reader: Any, path: str, header: frame.Header, out: np.ndarray[Any, Any] | None = None
    ) -> np.ndarray[Any, Any]:
        """The whole content of an open blob, decoded (into ``out`` when given): a compressed
        one straight into it, after its zstd frame's claimed content size was found to be the
        header's (:func:`frame.decode`), so nothing is allocated for a claim the caller did not
        account for. Memory: the content, plus the payload of a compressed blob (at most
        :func:`frame.compress_bound` of the content)."""
        shown = self.url(path)
        if header.codec == frame.RAW:
            if out is None:
                out = empty(header.raw_size, "a blob's content", shown)
            self._read_at(reader, path, HEADER, out)
            return out
        payload = empty(header.stored_size, "a compressed blob", shown)
        self._read_at(reader, path, HEADER, payload)
        frame.check_frame(header, payload, shown=shown)
        if out is None:
            out = empty(header.raw_size, "a blob's content", shown)
        frame.decode(header, payload, out, shown=shown)
        return out

    def read(
        self,
        digest: str,
        *,
        size: int | None = None,
        out: Any = None,
        verify: bool = True,
        check: str | None = None,
    ) -> np.ndarray[Any, Any]:
        """The content of blob ``digest`` as a uint8 array (into ``out`` when given). ``size``:
        the content size the caller expects (a recipe's), checked before anything is allocated.
        ``verify``: hash the content and compare with the name, or (``check``: the content's
        XXH3-64 from a recipe) with that, at XXH3 speed."""
        path = self.path(digest)
        with self._reader(path) as reader:
            header = self._header(reader, path, size)
            if out is not None:
                target = self._read_payload(reader, path, header, out_array(out, header.raw_size))
            else:
                target = self._read_payload(reader, path, header)
        if verify:
            self._verify_content(digest, target, path, check)
        return target

    def read_range(
        self,
        digest: str,
        start: int,
        end: int,
        *,
        size: int | None = None,
        out: Any = None,
        verify: bool = False,
        check: str | None = None,
    ) -> np.ndarray[Any, Any]:
        """Content bytes ``[start, end)`` of blob ``digest``: read in place from a raw blob,
        decoded whole from a compressed one. ``verify`` reads (and checks, as :meth:`read`
        does) the whole blob."""
        path = self.path(digest)
        with self._reader(path) as reader:
            header = self._header(reader, path, size)
            if not 0 <= start <= end <= header.raw_size:
                raise ValueError(
                    f"range [{start}, {end}) outside blob {digest} of {header.raw_size} bytes"
                )
            target = (
                empty(end - start, "a blob's range", self.url(path))
                if out is None
                else out_array(out, end - start)
            )
            if header.codec == frame.RAW and not verify:
                self._read_at(reader, path, HEADER + start, target)
                return target
            whole = self._read_payload(reader, path, header)
        if verify:
            self._verify_content(digest, whole, path, check)
        target[:] = whole[start:end]
        return target

    def verify(self, digest: str, *, size: int | None = None) -> None:
        """Read blob ``digest`` whole and check it against its name; CorruptCheckpointError
        (missing, truncated, damaged header, wrong content) otherwise."""
        self.read(digest, size=size, verify=True)

    def info(self, digest: str) -> BlobInfo:
        path = self.path(digest)
        st = self.store.stat(path)
        with self._reader(path) as reader:
            header = self._header(reader, path, None)
        codec = "raw" if header.codec == frame.RAW else "zstd"
        return BlobInfo(
            digest, codec, header.raw_size, HEADER + header.stored_size, st.mtime if st else 0.0
        )


class RecipeReads(Reads):
    """Reading and checking the content a :class:`Recipe` describes: its chunks, and a patched
    recipe's patches applied (see :class:`savepoint.blobs.store.BlobStore`)."""

    def read_recipe(
        self,
        recipe: Recipe,
        *,
        out: Any = None,
        start: int = 0,
        end: int | None = None,
        verify: bool = True,
        full: bool = False,
        workers: int = 1,
    ) -> np.ndarray[Any, Any]:
        """Bytes ``[start, end)`` (all by default) of the content a :class:`Recipe` describes,
        into ``out`` when given; only the chunks holding them are read. ``verify`` checks every
        chunk read (whole chunks are read then) against the recipe's XXH3-64 checks, or, where
        it has none or ``full``, against its digest (BLAKE3: 5-8x slower). A patched recipe's
        base is read, each patch applied (read whole, checked against its own XXH3-64 or, with
        ``full``, its name), and with ``verify`` the result checked against ``checks``."""
        if recipe.algorithm != self.algorithm:
            raise IncompatibleCheckpointError(
                f"a {recipe.algorithm} recipe cannot name blobs of the {self.algorithm} store "
                f"{self.url()}",
                path=self.url(),
            )
        end = recipe.size if end is None else end
        if not 0 <= start <= end <= recipe.size:
            raise ValueError(f"range [{start}, {end}) outside {recipe.size} bytes")
        target = (
            empty(end - start, "a tensor's blobs", self.url())
            if out is None
            else out_array(out, end - start)
        )
        if recipe.patches:
            return self._read_patched(recipe, target, start, end, verify, full, workers)
        checks: Sequence[str | None] = (
            recipe.checks if recipe.checks and not full else [None] * len(recipe.digests)
        )
        jobs = [
            (d, s, e, c)
            for (d, s, e), c in zip(recipe.spans(), checks)
            if e > start and s < end  # overlaps
        ]

        def one(job: tuple[str, int, int, str | None]) -> None:
            d, s, e, c = job
            lo, hi = max(s, start), min(e, end)
            dst = target[lo - start : hi - start]
            if lo == s and hi == e:
                self.read(d, size=e - s, out=dst, verify=verify, check=c)
            else:
                self.read_range(d, lo - s, hi - s, size=e - s, out=dst, verify=verify, check=c)

        if workers > 1 and len(jobs) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(workers, len(jobs))) as pool:
                list(pool.map(one, jobs))
        else:
            for job in jobs:
                one(job)
        return target

    def _read_patched(
        self,
        recipe: Recipe,
        target: np.ndarray[Any, Any],
        start: int,
        end: int,
        verify: bool,
        full: bool,
        workers: int,
    ) -> np.ndarray[Any, Any]:
        """:meth:`read_recipe` of a patched recipe into ``target`` (bytes ``[start, end)``):
        checked, the whole chunks holding the range (:meth:`_patched_checked`); unchecked, the
        base's bytes of the range. Either way the patches are then read and applied one at a
        time (:meth:`_apply_patches`), so the memory a read holds is ``target`` (plus, for a
        range that does not start and end on chunk boundaries, the chunks holding it) and one
        patch, however many patches the recipe names."""
        if verify:
            chunk = recipe.chunk
            lo = start // chunk * chunk
            hi = min(-(-end // chunk) * chunk, recipe.size)
            work = target
            if (lo, hi) != (start, end):
                work = empty(hi - lo, "the chunks of a patched tensor", self.url())
            self._patched_checked(recipe, work, lo // chunk, -(-hi // chunk), full, workers)
        else:
            lo, hi, work = start, end, target
            base = recipe.base()
            self.read_recipe(base, out=work, start=lo, end=hi, verify=False, workers=workers)
            self._apply_patches(recipe, work, lo, hi, verify=full, full=full)
        if work is not target:
            target[:] = work[start - lo : end - lo]
        return target

    def _patched_checked(
        self,
        recipe: Recipe,
        work: np.ndarray[Any, Any],
        first: int,
        last: int,
        full: bool,
        workers: int = 1,
    ) -> None:
        """Chunks ``[first, last)`` of a patched recipe's content into ``work`` (exactly those
        chunks' bytes), checked: each base chunk against its XXH3-64 (and, with ``full``, its
        name), then each patch read, checked and applied in turn, then each chunk of the result
        against the recipe's checks."""
        chunk = recipe.chunk
        lo, hi = first * chunk, min(last * chunk, recipe.size)
        base = recipe.base()
        self.read_recipe(base, out=work, start=lo, end=hi, verify=True, full=full, workers=workers)
        if full:  # checked against the names above; the XXH3-64 too, as verify_recipe does
            for i in range(first, last):
                s = i * chunk - lo
                part = work[s : min(s + chunk, hi - lo)]
                self._verify_content(
                    base.digests[i], part, self.path(base.digests[i]), base.checks[i]
                )
        self._apply_patches(recipe, work, lo, hi, verify=True, full=full)
        for i in range(first, last):
            s = i * chunk - lo
            part = work[s : min(s + chunk, hi - lo)]
            if _checksum.digest(part) != recipe.checks[i]:
                raise CorruptCheckpointError(
                    f"blobs of {self.url()}: chunk {i} of a patched tensor does not match its "
                    "checksum once its patches are applied (corrupt)",
                    path=self.url(),
                )

    def _apply_patches(
        self,
        recipe: Recipe,
        work: np.ndarray[Any, Any],
        lo: int,
        hi: int,
        *,
        verify: bool,
        full: bool,
    ) -> None:
        """Apply every patch of ``recipe``, in order, to ``work`` (content bytes ``[lo, hi)``):
        each read whole (checked, with ``verify``, against its XXH3-64 and, with ``full``, its
        name), applied, and dropped before the next is read. A patch naming the blob the one
        before it named is not read again."""
        from savepoint.blobs.patch import apply_patch

        held: np.ndarray[Any, Any] | None = None
        held_as: tuple[str, int, str] | None = None  # (blob, size, check) of ``held``
        for p in recipe.patches:
            size = p.content_size(recipe.size)
            if held_as is None or held_as[:2] != (p.blob, size):
                held = held_as = None  # the previous content goes before the next is read
                held = self._patch_content(recipe, p, verify=verify, full=full)
                held_as = (p.blob, size, p.check)
            elif verify and held_as[2] != p.check:
                self._verify_content(p.blob, held, self.path(p.blob), p.check)
            assert held is not None
            apply_patch(held, p, recipe.size, work, lo, hi, shown=self.url(self.path(p.blob)))

    def _patch_content(
        self, recipe: Recipe, p: Patch, *, verify: bool, full: bool
    ) -> np.ndarray[Any, Any]:
        """A patch's content: checked (``verify``) against its XXH3-64, and (``full``) its
        name."""
        size = p.content_size(recipe.size)
        if not verify:
            return self.read(p.blob, size=size, verify=full)
        content = self.read(p.blob, size=size, verify=True, check=p.check)
        if full:
            self._verify_content(p.blob, content, self.path(p.blob))
        return content

    def verify_recipe(self, recipe: Recipe) -> None:
        """Every blob of ``recipe`` against its digest, and its XXH3-64 check where it has one;
        a patched recipe's result against its checks too."""
        if recipe.patches:
            self._verify_patched(recipe)
            return
        checks: Sequence[str | None] = recipe.checks or [None] * len(recipe.digests)
        for (d, s, e), c in zip(recipe.spans(), checks):
            content = self.read(d, size=e - s, verify=True)
            if c is not None:
                self._verify_content(d, content, self.path(d), c)

    def _verify_patched(self, recipe: Recipe) -> None:
        """:meth:`verify_recipe` of a patched recipe: each patch and each base chunk against
        its name and its XXH3-64, and each chunk of the result against ``checks``; one read of
        every blob. In memory: the patches and one chunk, where the patches' contents add up to
        at most the tensor (:meth:`patches_in_memory`: every chain a writer makes); otherwise
        the whole tensor and one patch (the patches applied one at a time)."""
        if not self.patches_in_memory(recipe):
            work = empty(recipe.size, "a patched tensor", self.url())
            self._patched_checked(recipe, work, 0, len(recipe.digests), full=True)
            return
        patches = self.patch_contents(recipe, full=True)
        buf = empty(min(recipe.chunk, recipe.size), "a chunk", self.url())
        for i in range(len(recipe.digests)):
            self.read_chunk(recipe, i, patches=patches, full=True, out=buf)

    @staticmethod
    def patches_in_memory(recipe: Recipe) -> bool:
        """Whether the contents of ``recipe``'s patches add up to at most its content size, so
        that holding them all (:meth:`patch_contents`, for :meth:`read_chunk`) stays within the
        tensor's own size. A writer's chains always do (``BlobPolicy.patch_budget``, at most
        1); a forged recipe naming a big patch 1,024 times does not, and its readers apply the
        patches one at a time instead."""
        return recipe.patch_bytes() <= recipe.size

    def patch_contents(self, recipe: Recipe, *, full: bool = False) -> list[np.ndarray[Any, Any]]:
        """The content of every patch of ``recipe``, in order, each checked against its XXH3-64
        and, with ``full``, its name (for :meth:`read_chunk`). A blob named by several patches
        is read once. Holds them all: callers check :meth:`patches_in_memory` first."""
        out = []
        seen: dict[tuple[str, int], tuple[str, np.ndarray[Any, Any]]] = {}
        for p in recipe.patches:
            key = (p.blob, p.content_size(recipe.size))
            found = seen.get(key)
            if found is None:
                found = seen[key] = (
                    p.check,
                    self._patch_content(recipe, p, verify=True, full=full),
                )
            elif found[0] != p.check:
                self._verify_content(p.blob, found[1], self.path(p.blob), p.check)
            out.append(found[1])
        return out

    def read_chunk(
        self,
        recipe: Recipe,
        index: int,
        *,
        patches: Sequence[np.ndarray[Any, Any]] | None = None,
        full: bool = False,
        out: np.ndarray[Any, Any] | None = None,
    ) -> np.ndarray[Any, Any]:
        """Chunk ``index`` of the content ``recipe`` describes, checked: its blob against its
        XXH3-64 (and, with ``full``, its name); for a patched recipe, the base chunk so, the
        patches applied (``patches``: :meth:`patch_contents`; when None, each read and applied
        in turn) and the result against the chunk's check. Into ``out`` (at least a chunk) when
        given."""
        from savepoint.blobs.patch import apply_patch

        d, s = recipe.digests[index], index * recipe.chunk
        e = min(s + recipe.chunk, recipe.size)
        part = (
            empty(e - s, "a chunk", self.url()) if out is None else out_array(out[: e - s], e - s)
        )
        if recipe.patches and patches is None:
            self._patched_checked(recipe, part, index, index + 1, full)
            return part
        checks = recipe.base_checks if recipe.patches else recipe.checks
        check = checks[index] if checks else None
        self.read(d, size=e - s, out=part, verify=True, check=check)
        if full and check is not None:
            self._verify_content(d, part, self.path(d))
        if not recipe.patches:
            return part
        assert patches is not None
        for p, content in zip(recipe.patches, patches):
            apply_patch(content, p, recipe.size, part, s, e, shown=self.url(self.path(p.blob)))
        if _checksum.digest(part) != recipe.checks[index]:
            raise CorruptCheckpointError(
                f"blobs of {self.url()}: chunk {index} of a patched tensor does not match its "
                "checksum once its patches are applied (corrupt)",
                path=self.url(),
            )
        return part
