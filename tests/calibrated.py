"""The warm start and actor lr schedule that the learning margins of the recipe-level tests
were calibrated on (the recipe's defaults before it moved to a longer warm start at a lower
lr and a cosine RL schedule, which dip first and climb over 100 steps: too long for these
tests; benchmarks/separate_async_seeds.py measures the recipe's own)."""

CALIBRATED_WARM_START = ("warm_start.steps=60", "warm_start.lr=3e-3", "actor.lr_schedule=constant")
