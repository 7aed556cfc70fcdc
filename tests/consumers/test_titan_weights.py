"""The embedded engine's weight loads: the bytes land in one buffer kept from version to version,
checked as they land; the model takes views of them; bytes changed on their way, or another
version's, are refused and the engine keeps what it had."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from jetrl.bus import events as ev
from jetrl.bus.payloads import FilePayloads, PayloadIntegrityError, Payloads
from jetrl.consumers.inference.settings import InferencePart, InferenceSettings
from jetrl.consumers.inference.titan_engine import TitanEngine
from jetrl.policy.models import build_model
from jetrl.policy.settings import ModelSettings
from jetrl.policy.weights import ChecksumMismatch, checksum, export_weights


async def test_loads_are_checked_into_one_buffer_and_a_changed_bit_is_refused(tmp_path: Path) -> None:
    part = InferencePart(inference=InferenceSettings(precision="fp32"), model=ModelSettings(name="tiny-moe"))
    engine = TitanEngine(part, "inf-0")
    files = FilePayloads(tmp_path, "w")
    payloads = Payloads(files)

    async def publish(version: int, seed: int) -> tuple[ev.WeightsReady, str]:
        exported = export_weights(build_model("tiny-moe", seed=seed), {"version": str(version)})
        ref = await files.put(f"weights-v{version}", exported.data, sha256=False)
        ready = ev.WeightsReady(
            version=version, location=ref, weights_checksum=exported.checksum, blake3=exported.blake3
        )
        return ready, exported.checksum

    buffers, digest = [], ""
    for version, seed in ((1, 11), (2, 12)):
        ready, digest = await publish(version, seed)
        await engine.load_weights(ready, payloads)
        assert engine.loaded_version == version and checksum(engine.model) == digest
        buffers.append(engine._received(ready.location.size).obj)
    assert buffers[0] is buffers[1]  # the same memory, version after version
    # One bit changed on the way (in the store here), anywhere: refused, the model untouched.
    ready, _ = await publish(3, 13)
    path = tmp_path / "w" / "weights-v3"
    good = path.read_bytes()
    for at in (len(good) - 1, 10, len(good) // 2):
        bad = bytearray(good)
        bad[at] ^= 0x01
        path.write_bytes(bad)
        with pytest.raises(PayloadIntegrityError, match="BLAKE3"):
            await engine.load_weights(ready, payloads)
        assert engine.loaded_version == 2 and checksum(engine.model) == digest
    path.write_bytes(good[:-8])
    with pytest.raises(PayloadIntegrityError, match="holds"):
        await engine.load_weights(ready, payloads)
    # Intact bytes of another version than announced.
    path.write_bytes(good)
    with pytest.raises(ChecksumMismatch):
        await engine.load_weights(msgspec.structs.replace(ready, weights_checksum="0" * 64), payloads)
    assert engine.loaded_version == 2 and checksum(engine.model) == digest
    await engine.load_weights(ready, payloads)
    assert engine.loaded_version == 3
    assert all(torch.isfinite(p).all() for p in engine.model.parameters())
