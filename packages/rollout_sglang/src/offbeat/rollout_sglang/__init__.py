"""SGLang rollout adapter for offbeat — not implemented yet; this package holds no code.

What it will be: `SGLangServer`, an implementation of `offbeat.core.rollout.RolloutServer`
(one Ray actor per replica) that starts `sglang.launch_server` as its own process and
talks to it over HTTP with token ids only (generate with log-probs, abort, pause /
continue, release / resume of the KV cache), plus the receiving side of a weight sync
(`offbeat.ckpt_engine.SyncTarget`). It will register as the rollout engine "sglang"
through the `offbeat.rollout_engines` entry-point group. Until then, `rollout.engine`
accepts only the engines that are registered (see `offbeat.core.registry`).
"""

__all__: list[str] = []
