"""Megatron-Core train engine for offbeat: `MegatronTrainEngine`, an implementation of
`offbeat.core.train.TrainEngine` on a Megatron GPTModel with tensor, pipeline and data
parallelism, and the HF <-> Megatron weight conversion it loads and exports through.

Registered as the train engine "megatron" through the `offbeat.train_engines`
entry-point group (`register`). Importing this package does not import megatron-core:
the engine imports it when it is built, so configs can be checked without it.
"""

from offbeat.backend_megatron.config import MegatronConfig, megatron_config
from offbeat.backend_megatron.convert import (
    SUPPORTED_MODEL_TYPES,
    DecoderSpec,
    hf_to_megatron,
    join_tp_shards,
    megatron_names,
    megatron_to_hf,
    split_tp_shard,
)
from offbeat.backend_megatron.engine import MegatronTrainEngine


def register() -> None:
    """Entry-point hook of `offbeat.train_engines`: importing this package registered
    "megatron" already (the engine class's decorator)."""


__all__ = [  # the engine and its config, the conversion table, the registry hook
    "SUPPORTED_MODEL_TYPES",
    "DecoderSpec",
    "MegatronConfig",
    "MegatronTrainEngine",
    "hf_to_megatron",
    "join_tp_shards",
    "megatron_config",
    "megatron_names",
    "megatron_to_hf",
    "register",
    "split_tp_shard",
]
