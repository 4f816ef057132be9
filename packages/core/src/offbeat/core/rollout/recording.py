"""The on-disk form of a rollout recording: `manifest.json` plus one safetensors file per
recorded step, and the identity of the run that made it.

A step file holds the padded `TrajectoryBatch` the trainer consumed (token ids, masks,
rollout log-probs, rewards, weight versions, extras as tensors; group uids, session ids
and each row's data_source in the safetensors header). The manifest names the model, its
config and the tokenizer's vocabulary (what must match for a replay), the config hash and
offbeat version (for the record), and every complete step with its size and sha256.
Every write is atomic (a temporary file in the same directory, then `os.replace`), and a
step is listed only after its file is complete: a crash never leaves half a step.

Knows nothing about the trainer, the buffer or the engines; no pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offbeat.core.data import TrajectoryBatch

if TYPE_CHECKING:
    from offbeat.core.config.schema import JobConfig

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "REPLAY_MODES",
    "CorruptRecording",
    "RecordingError",
    "RecordingMismatch",
    "config_digest",
    "decode_step",
    "encode_step",
    "group_runs",
    "identity_mismatches",
    "model_config_digest",
    "read_manifest",
    "read_step_metadata",
    "run_identity",
    "step_file",
    "step_metadata",
    "tokenizer_digest",
    "verify_files",
    "write_atomic",
]

# rollout.replay.mode: each recorded step once, then live generation; or cycle for good.
REPLAY_MODES = ("cache", "repeat")

FORMAT = "offbeat-rollout-recording"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
_TENSORS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "rollout_log_probs",
    "rewards",
    "min_weight_version",
    "max_weight_version",
)
# What a replay needs to match, and how to name it in a refusal.
IDENTITY_KEYS = {
    "model": "model.path",
    "model_config_sha256": "the model's config.json",
    "tokenizer_sha256": "the tokenizer's vocabulary and special tokens",
    "vocab_size": "the vocabulary size",
    "n": "rollout.n (trajectories per prompt group)",
}


class RecordingError(ValueError):
    """A directory that cannot be replayed or recorded into, with the reason."""


class CorruptRecording(RecordingError):
    """A manifest or step file that is missing, truncated, altered or unreadable."""


class RecordingMismatch(RecordingError):
    """A recording made with another model, tokenizer, vocabulary or group size."""


# ---- identity ------------------------------------------------------------------------------
def tokenizer_digest(tokenizer: Any) -> tuple[str, int]:
    """(sha256 of the vocabulary and special tokens, vocabulary size)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    special = {
        "eos": getattr(tokenizer, "eos_token_id", None),
        "pad": getattr(tokenizer, "pad_token_id", None),
        "bos": getattr(tokenizer, "bos_token_id", None),
    }
    text = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest(), len(tokenizer)


def model_config_digest(model_dir: str | Path) -> str:
    """sha256 of the model's config.json, minus what names where or by what it was saved
    ("" when the directory has none)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return ""
    config = json.loads(path.read_text())
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def run_identity(model: str, model_dir: str | Path, tokenizer: Any, n: int) -> dict[str, Any]:
    """What a recording and its replay must share (see `IDENTITY_KEYS`). `model`: the
    config's model.path as written (before an `offbeat-tiny:` name is resolved)."""
    tok_sha, vocab_size = tokenizer_digest(tokenizer)
    return {
        "model": model,
        "model_config_sha256": model_config_digest(model_dir),
        "tokenizer_sha256": tok_sha,
        "vocab_size": vocab_size,
        "n": n,
    }


def identity_mismatches(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One line per identity key whose value differs ([] when the recording fits)."""
    return [
        f"{label}: recorded {recorded.get(key)!r}, this run {current.get(key)!r}"
        for key, label in IDENTITY_KEYS.items()
        if recorded.get(key) != current.get(key)
    ]


def config_digest(cfg: JobConfig) -> str:
    """sha256 of the job config without its record/replay sections (for the manifest)."""
    d = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else dict(cfg)
    rollout = dict(d.get("rollout", {}))
    rollout.pop("record", None)
    rollout.pop("replay", None)
    d["rollout"] = rollout
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


# ---- files ---------------------------------------------------------------------------------
def step_file(step: int) -> str:
    return f"step_{step:06d}.safetensors"


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the new one, whole."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of the recording in `directory`; raises `RecordingError` saying why
    it is not one."""
    d = Path(directory)
    path = d / MANIFEST
    if not d.is_dir():
        raise RecordingError(f"{str(d)!r} is not a directory")
    if not path.is_file():
        raise RecordingError(
            f"{str(d)!r} holds no {MANIFEST}: not a rollout recording (make one with "
            f"rollout.record.dir)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptRecording(f"{path}: unreadable manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptRecording(f"{path}: not an offbeat rollout recording manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise RecordingError(
            f"{path}: recording format version {version!r}; this offbeat reads version "
            f"{FORMAT_VERSION} (recorded with offbeat {manifest.get('offbeat_version')!r})"
        )
    steps = manifest.get("steps")
    if not isinstance(steps, list) or not isinstance(manifest.get("identity"), dict):
        raise CorruptRecording(f"{path}: manifest without its steps or identity")
    return manifest


def verify_files(directory: str | Path, manifest: dict[str, Any], *, hashes: bool) -> None:
    """Every listed step file exists with its recorded size (and sha256 when `hashes`);
    raises `CorruptRecording` naming the first that does not."""
    d = Path(directory)
    for entry in manifest["steps"]:
        try:
            well_formed = entry["file"] == step_file(entry["step"]) and entry["bytes"] >= 0
            well_formed = well_formed and isinstance(entry["sha256"], str)
        except (KeyError, TypeError, ValueError):
            well_formed = False
        if not well_formed:
            raise CorruptRecording(f"{d / MANIFEST}: malformed step entry {entry!r}")
        path = d / entry["file"]
        if not path.is_file():
            raise CorruptRecording(f"{path}: step {entry['step']} is listed but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise CorruptRecording(
                f"{path}: {size} bytes, recorded {entry['bytes']} (truncated or altered)"
            )
        if hashes:
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != entry["sha256"]:
                raise CorruptRecording(
                    f"{path}: sha256 {digest.hexdigest()[:16]}..., recorded "
                    f"{entry['sha256'][:16]}... (the file was altered or damaged)"
                )


# ---- one step ------------------------------------------------------------------------------
def encode_step(
    step: int, batch: TrajectoryBatch, data_sources: list[str], weight_version: int
) -> bytes:
    """The safetensors bytes of one trained batch."""
    from safetensors.torch import save

    if len(data_sources) != len(batch):
        raise ValueError(f"{len(data_sources)} data sources for {len(batch)} rows")
    tensors = {name: getattr(batch, name).contiguous() for name in _TENSORS}
    tensors.update({f"extras.{k}": v.contiguous() for k, v in batch.extras.items()})
    metadata = {
        "step": str(step),
        "weight_version": str(weight_version),
        "pad_token_id": str(batch.pad_token_id),
        "group_uids": json.dumps(batch.group_uids),
        "session_ids": json.dumps(batch.session_ids),
        "data_sources": json.dumps(data_sources),
    }
    return save(tensors, metadata=metadata)


def step_metadata(data: bytes) -> dict[str, str]:
    """The header metadata of a step file's bytes (read without loading the tensors)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return dict(header.get("__metadata__") or {})


def read_step_metadata(path: str | Path) -> dict[str, str]:
    """The header metadata of a step file, reading only its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptRecording(f"{path}: too short for a step file")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    try:
        return step_metadata(head + raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptRecording(f"{path}: unreadable step header ({e})") from e


def decode_step(data: bytes, name: str = "step") -> tuple[TrajectoryBatch, dict[str, Any]]:
    """(the batch, its metadata with the JSON lists decoded) from a step file's bytes;
    raises `CorruptRecording` when they do not hold one."""
    from safetensors.torch import load

    try:
        meta: dict[str, Any] = step_metadata(data)
        tensors = load(data)
        for key in ("group_uids", "session_ids", "data_sources"):
            meta[key] = json.loads(meta[key])
        batch = TrajectoryBatch(
            **{k: tensors[k] for k in _TENSORS},
            group_uids=list(meta["group_uids"]),
            session_ids=list(meta["session_ids"]),
            extras={k[len("extras.") :]: v for k, v in tensors.items() if k.startswith("extras.")},
            pad_token_id=int(meta["pad_token_id"]),
        )
        if len(meta["data_sources"]) != len(batch):
            raise ValueError(f"{len(meta['data_sources'])} data sources for {len(batch)} rows")
        meta["step"], meta["weight_version"] = int(meta["step"]), int(meta["weight_version"])
    except Exception as e:  # any malformed byte is the same problem: not a step file
        raise CorruptRecording(f"{name}: not a readable recorded step ({e})") from e
    return batch, meta


def group_runs(uids: list[str]) -> list[tuple[int, int]]:
    """[start, stop) row ranges of consecutive rows sharing a group uid (the trainer pads
    groups whole and in order)."""
    runs: list[tuple[int, int]] = []
    for i, uid in enumerate(uids):
        if runs and uids[runs[-1][0]] == uid:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs
