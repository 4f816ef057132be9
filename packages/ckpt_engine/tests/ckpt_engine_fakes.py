"""Fakes for the checkpoint-engine tests (importable by spawned children)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import traceback
import zlib

import torch

from offbeat.ckpt_engine import ReceiveSpec, receive

BUCKET = 4096  # small buckets so a tiny model spans many of them


def awkward_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    m = {
        "embed.weight": torch.randn(37, 19, generator=g).to(torch.bfloat16),
        "big.weight": torch.randn(3 * BUCKET // 16 + 5, 4, generator=g),  # > 3 buckets of fp32
        "layer.0.bias": torch.randn(7, generator=g, dtype=torch.float64),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "one": torch.tensor([42], dtype=torch.int64),
        "empty": torch.empty(0, 5),
        "mask": torch.rand(13, 3, generator=g) > 0.5,
        "strided": torch.randn(9, 11, generator=g).t(),
        "int8": torch.randint(-128, 127, (5, 3, 2), generator=g, dtype=torch.int8),
        "half": torch.randn(1, 1, 3, generator=g).half(),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }
    return m


def digest(t: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return (str(t.dtype), tuple(t.shape), zlib.crc32(b.numpy()) if b.numel() else 0)


class Sink:
    """A receiving 'model': load_weights copies every tensor (it must, buffers get reused)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.calls = 0

    def load_weights(self, pairs) -> None:
        self.calls += 1
        for name, t in pairs:
            self.weights[name] = t.clone()


class RecordingTarget:
    """An in-process SyncTarget that records every lifecycle call in a shared list."""

    def __init__(
        self,
        name: str,
        calls: list,
        version: int = 0,
        fail_in: str | None = None,
        hang_in: str | None = None,
    ) -> None:
        self.name, self.calls = name, calls
        self._version = version
        self.sink = Sink()
        self.fail_in, self.hang_in = fail_in, hang_in

    @property
    def weight_version(self) -> int:
        return self._version

    async def _step(self, phase: str) -> None:
        self.calls.append((self.name, phase))
        if self.hang_in == phase:
            await asyncio.sleep(3600)
        if self.fail_in == phase:
            raise RuntimeError(f"{self.name} broke in {phase}")

    async def abort_all(self) -> None:
        await self._step("abort")

    async def release_kv_cache(self) -> None:
        await self._step("release_kv")

    async def update_weights(self, spec: ReceiveSpec) -> int:
        await self._step("transfer")
        self._version = await asyncio.to_thread(
            receive, spec, self.sink.load_weights, self._version
        )
        return self._version

    async def resume_kv_cache(self) -> None:
        await self._step("resume_kv")

    async def resume(self) -> None:
        await self._step("resume")


# -- a receiver in its own process -------------------------------------------------------


def receiver_main(
    specs,
    results,
    kill_after: int | None = None,
    current_version: int = 0,
    into: dict | None = None,
) -> None:
    """Child process: run `receive` for every spec from `specs`; answer digests or errors.

    With `kill_after`, the process SIGKILLs itself inside load_weights of that bucket. With
    `into` ({name: (shape, dtype, device)}), weights land in a model allocated once and
    kept across syncs, through the package's `copy_into`.
    """
    from offbeat.ckpt_engine import copy_into

    held = current_version
    model = (
        {n: torch.zeros(shape, dtype=dtype, device=dev) for n, (shape, dtype, dev) in into.items()}
        if into
        else None
    )
    loader = copy_into(model) if model else None
    while True:
        spec = specs.get()
        if spec is None:
            return
        sink = Sink()

        def load(pairs, sink=sink):
            if kill_after is not None and sink.calls >= kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if loader is not None:
                sink.calls += 1
                loader(pairs)
            else:
                sink.load_weights(pairs)

        try:
            held = receive(spec, load, held)
            weights = model if model is not None else sink.weights
            results.put(("ok", held, {n: digest(t) for n, t in weights.items()}))
        except Exception as e:
            results.put(("error", type(e).__name__, str(e) + "\n" + traceback.format_exc(limit=3)))


class ProcessTarget:
    """A SyncTarget whose model lives in a spawned process (lifecycle calls are no-ops)."""

    def __init__(
        self, ctx, kill_after: int | None = None, version: int = 0, into: dict | None = None
    ) -> None:
        self.specs, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=receiver_main,
            args=(self.specs, self.results, kill_after, version, into),
            daemon=True,
        )
        self.proc.start()
        self._version = version
        self.last_digest: dict | None = None

    @property
    def weight_version(self) -> int:
        return self._version

    async def abort_all(self) -> None: ...

    async def release_kv_cache(self) -> None: ...

    async def resume_kv_cache(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights(self, spec: ReceiveSpec) -> int:
        self.specs.put(spec)
        deadline = time.monotonic() + spec.timeout_s + 30
        while time.monotonic() < deadline:
            try:
                out = await asyncio.to_thread(self.results.get, True, 0.2)
            except Exception:
                if not self.proc.is_alive():
                    raise RuntimeError(
                        f"receiver process died (exit code {self.proc.exitcode})"
                    ) from None
                continue
            if out[0] == "ok":
                self._version, self.last_digest = out[1], out[2]
                return self._version
            raise RuntimeError(f"{out[1]}: {out[2]}")
        raise TimeoutError("receiver process gave no answer")

    def close(self) -> None:
        if self.proc.is_alive():
            self.specs.put(None)
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
