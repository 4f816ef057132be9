"""Megatron-Core train engine for offbeat — not implemented yet; this package holds no code.

What it will be: `MegatronTrainEngine`, an implementation of
`offbeat.core.train.TrainEngine` (forward log-probs, PPO update on a mini-batch with the
global loss normaliser of `offbeat.core.algorithms`, export of weights as HF-named
tensors for the checkpoint engine, save/load) on megatron-core's tensor, pipeline,
context and expert parallelism. It will register as the train engine "megatron" through
the `offbeat.train_engines` entry-point group. megatron-core is imported only here,
never by offbeat-core.
"""

__all__: list[str] = []
