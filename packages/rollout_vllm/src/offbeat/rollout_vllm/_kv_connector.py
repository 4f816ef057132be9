"""vLLM's shared-storage example connector (`ExampleConnector`, vLLM 0.24 to 0.32), with
the three changes a prefill-decode replica needs. vLLM loads this module by name in its
engine-core and worker processes (`kv_connector_module_path`); nothing else imports it.

It knows nothing about offbeat's replica: only how the example connector names, finds,
stores and loads a prompt's KV cache (one folder per prompt under `shared_storage_path`,
one safetensors file per layer), and what it gets wrong for a P engine and a D engine:

- upstream looks a prompt up under the folder of its first `(n - 2) // block * block`
  tokens but stores and loads the one of its first `(n - 1) // block * block`: for
  `n % block == 1` a hit loads a folder that does not exist. Here the lookup uses the
  folder that is loaded;
- upstream stores every prompt it did not find, on every engine: here only a producer
  (`kv_role="kv_producer"`, the P engine) stores, and only a consumer (the D engine) loads;
- upstream can ask for fewer than zero tokens when the local prefix cache holds more than
  the folder; here at least zero.
"""

from __future__ import annotations

from typing import Any

from offbeat.rollout_vllm import compat

ExampleConnector = compat.resolve(f"{compat.EXAMPLE_CONNECTOR}:ExampleConnector")
align_to_block_size = compat.resolve(f"{compat.EXAMPLE_CONNECTOR}:align_to_block_size")

__all__ = ["OffbeatSharedStorageConnector"]


class OffbeatSharedStorageConnector(ExampleConnector):
    """`ExampleConnector` with consistent lookups and one direction per role."""

    def _role_is(self, role: str) -> bool:
        return self._kv_transfer_config.kv_role == role

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._role_is("kv_producer") or not self._found_match_for_request(request):
            return 0, False
        # As upstream: the engine computes at least the prompt's last token itself.
        tokens = align_to_block_size(len(request.prompt_token_ids or []) - 1, self._block_size)
        return max(0, tokens - num_computed_tokens), False

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._role_is("kv_consumer"):
            meta.requests = [r for r in meta.requests if not r.is_store]
        return meta

    def _found_match_for_prompt(self, prompt_token_ids: list[int], mm_hashes: list[str]) -> bool:
        import os

        import torch

        # The folder start_load_kv reads: the first (n - 1) // block * block tokens.
        tokens = align_to_block_size(len(prompt_token_ids), self._block_size)
        if tokens <= 0:
            return False
        folder = self._generate_foldername_debug(
            torch.tensor(prompt_token_ids)[:tokens], mm_hashes, create_folder=False
        )
        return os.path.exists(folder)
