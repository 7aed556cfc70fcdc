"""A payload store: each object zlib-compressed in a file of the run's shared directory
(``<dir>/zipped/<bucket>/<name>.z``). References carry the bytes' own size and SHA-256, as for
every store; its checks keep routing traces out of it."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable
from pathlib import Path

from jetrl.bus import events as ev
from jetrl.bus.payloads import Buffer, PayloadError, PayloadIntegrityError, PayloadMissing, StoreSite
from jetrl.bus.payloads import sha256 as sha256_of
from jetrl.bus.settings import BusSettings


class ZippedPayloads:
    kind = "zipped"
    held_by_writer = False

    def __init__(self, root: Path, bucket: str) -> None:
        self.bucket = bucket
        self.dir = root / self.kind / bucket

    @classmethod
    async def open(cls, site: StoreSite) -> ZippedPayloads | None:
        if cls.kind not in site.uses:
            return None
        if site.directory is None:
            raise PayloadError("the zipped store needs the run's shared directory")
        return cls(site.directory, site.bucket)

    @classmethod
    def check(cls, bus: BusSettings) -> None:
        if bus.traces_store == cls.kind:
            raise ValueError("the zipped store keeps weights only")

    def _path(self, name: str) -> Path:
        if "/" in name or name.startswith("."):
            raise PayloadError(f"payload name {name!r} must be a plain file name")
        return self.dir / f"{name}.z"

    async def put(
        self, name: str, data: Buffer, *, sha256: bool = True, durable: bool = True
    ) -> ev.PayloadRef:
        path = self._path(name)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(zlib.compress(data))
            tmp.replace(path)

        await asyncio.to_thread(write)
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        digest = sha256_of(data) if sha256 else ""
        return ev.PayloadRef(store=self.kind, bucket=self.bucket, name=name, size=size, sha256=digest)

    async def get_bytes(self, ref: ev.PayloadRef) -> bytes:
        try:
            packed = await asyncio.to_thread(self._path(ref.name).read_bytes)
        except FileNotFoundError:
            raise PayloadMissing(f"payload {ref.name} is not in {self.dir}") from None
        return zlib.decompress(packed)

    async def read_into(self, ref: ev.PayloadRef, out: memoryview, progress: Callable[[int], None]) -> bool:
        data = await self.get_bytes(ref)
        if len(data) != out.nbytes:
            raise PayloadIntegrityError(f"payload {ref.name} holds {len(data)} bytes, not {out.nbytes}")
        out.cast("B")[:] = data
        progress(len(data))
        return False  # unchecked here: the caller checks the bytes

    async def discard(self, name: str) -> None:
        await asyncio.to_thread(self._path(name).unlink, missing_ok=True)
