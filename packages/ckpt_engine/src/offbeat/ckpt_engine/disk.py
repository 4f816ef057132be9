"""`disk`: one safetensors file per bucket in a directory, for debugging and for crossing
clusters (any shared or copied filesystem).

Layout of one sync: `<directory>/v<version>/bucket-00000.safetensors ...` plus
`manifest.json` (version, bucket count, per-file CRC-32), written last and atomically, so a
receiver never reads a half-written sync. Files hold whole tensors under their own names,
readable by any safetensors tool; a tensor split over files is stored as flat chunks named
`<name>@<start byte>`. Knows nothing about who copies the directory between machines.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import zlib
from typing import Any

import torch

from offbeat.ckpt_engine._shared_buffer import check_version
from offbeat.ckpt_engine.bucket import Entry, Reassembler, plan_buckets
from offbeat.ckpt_engine.errors import ChecksumError, PeerError, SyncTimeoutError
from offbeat.ckpt_engine.registry import Backend, NamedTensors, Sender, SendReport, register_backend
from offbeat.ckpt_engine.target import LoadWeightsFn, ReceiveSpec

__all__ = ["DiskBackend"]

MANIFEST = "manifest.json"
ABORTED = "ABORTED"


def _bucket_file(i: int) -> str:
    return f"bucket-{i:05d}.safetensors"


class _DiskSender(Sender):
    def __init__(
        self,
        root: str,
        version: int,
        n: int,
        bucket_bytes: int,
        checksum: bool,
        timeout_s: float,
        keep: int,
    ) -> None:
        self._root, self._version, self._n = root, version, n
        self._bucket_bytes, self._checksum, self._timeout, self._keep = (
            bucket_bytes,
            checksum,
            timeout_s,
            keep,
        )
        self._dir = os.path.join(root, f"v{version}")

    def spec(self, rank: int) -> ReceiveSpec:
        return ReceiveSpec(
            "disk", self._version, {"directory": self._dir}, rank, self._checksum, self._timeout
        )

    def abort(self, reason: str) -> None:
        # Receivers waiting for the manifest see this instead and stop.
        os.makedirs(self._dir, exist_ok=True)
        with open(os.path.join(self._dir, ABORTED), "w") as f:
            f.write(reason)

    def send(self, named_tensors: NamedTensors) -> SendReport:
        from safetensors.torch import save

        t0 = time.perf_counter()
        report = SendReport()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.makedirs(self._dir)
        files = []
        for bucket in plan_buckets(named_tensors, self._bucket_bytes):
            tensors: dict[str, torch.Tensor] = {}
            for e, src in zip(bucket.entries, bucket.sources, strict=True):
                key = e.name if e.whole else f"{e.name}@{e.start}"
                if e.whole:
                    piece = (
                        src.view(getattr(torch, e.dtype)).view(e.shape)
                        if e.nbytes
                        else torch.empty(e.shape, dtype=getattr(torch, e.dtype))
                    )
                else:
                    piece = src
                tensors[key] = piece.cpu()
            meta = {"entries": json.dumps([e.to_json() for e in bucket.entries])}
            data = save(tensors, metadata=meta)
            del tensors, bucket
            name = _bucket_file(report.buckets)
            with open(os.path.join(self._dir, name), "wb") as f:
                f.write(data)
            files.append(
                {
                    "file": name,
                    "crc32": zlib.crc32(data) if self._checksum else None,
                    "bytes": len(data),
                }
            )
            report.buckets += 1
            report.bytes += len(data)
        manifest = {"version": self._version, "buckets": files}
        fd, tmp = tempfile.mkstemp(dir=self._dir)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f)
        os.replace(tmp, os.path.join(self._dir, MANIFEST))
        self._prune()
        report.seconds = time.perf_counter() - t0
        return report

    def _prune(self) -> None:
        """Keep the `keep` newest syncs. Receivers still reading an older one are done:
        the manager waits for every receiver before the next sync starts."""
        versions = []
        for d in os.listdir(self._root):
            if d.startswith("v") and d[1:].isdigit() and int(d[1:]) < self._version:
                versions.append(int(d[1:]))
        for v in sorted(versions)[: max(0, len(versions) - (self._keep - 1))]:
            shutil.rmtree(os.path.join(self._root, f"v{v}"), ignore_errors=True)


class DiskBackend(Backend):
    """Options: `directory` (default: a fresh temporary directory), `keep` (syncs kept on disk,
    default 1)."""

    def __init__(self, directory: str | None = None, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"disk backend: keep must be >= 1, got {keep}")
        self._owned = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="offbeat-ckpt-")
        self._keep = keep

    def open_sender(
        self,
        *,
        version: int,
        num_receivers: int,
        bucket_bytes: int,
        checksum: bool,
        timeout_s: float,
        members: tuple[str, ...] = (),
    ) -> Sender:
        os.makedirs(self.directory, exist_ok=True)
        return _DiskSender(
            self.directory, version, num_receivers, bucket_bytes, checksum, timeout_s, self._keep
        )

    def close(self) -> None:
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)

    @classmethod
    def receive(
        cls, spec: ReceiveSpec, load_weights: LoadWeightsFn, current_version: int | None
    ) -> int:
        from safetensors.torch import load

        check_version(spec, current_version)
        directory = spec.channel["directory"]
        path = os.path.join(directory, MANIFEST)
        deadline = time.monotonic() + spec.timeout_s
        while not os.path.exists(path):
            aborted = os.path.join(directory, ABORTED)
            if os.path.exists(aborted):
                with open(aborted) as f:
                    raise PeerError(f"the sender aborted the sync: {f.read()}")
            if time.monotonic() > deadline:
                raise SyncTimeoutError(f"no {MANIFEST} in {directory} within {spec.timeout_s:.1f}s")
            time.sleep(0.02)
        with open(path) as f:
            manifest: dict[str, Any] = json.load(f)
        if manifest["version"] != spec.version:
            raise PeerError(
                f"{directory} holds version {manifest['version']}, expected {spec.version}"
            )
        reasm = Reassembler()
        for i, item in enumerate(manifest["buckets"]):
            with open(os.path.join(directory, item["file"]), "rb") as f:
                data = f.read()
            if spec.checksum and item["crc32"] is not None and zlib.crc32(data) != item["crc32"]:
                raise ChecksumError(i, item["crc32"], zlib.crc32(data))
            tensors = load(data)
            entries = [Entry.from_json(e) for e in json.loads(_metadata(data)["entries"])]
            del data
            out = []
            for e in entries:
                if e.whole:
                    out.append((e.name, tensors[e.name]))
                else:
                    out.extend(
                        reasm.take(
                            [Entry(e.name, e.dtype, e.shape, 0, e.nbytes, e.start, e.total)],
                            tensors[f"{e.name}@{e.start}"],
                        )
                    )
            if out:
                load_weights(out)
            del tensors, out
        reasm.finish()
        return spec.version


def _metadata(data: bytes) -> dict[str, str]:
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})


register_backend("disk", DiskBackend)
