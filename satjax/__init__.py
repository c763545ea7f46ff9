"""satjax: asynchronous RL for MoE language models with SAT and routing replay (R3).

The data path is one-way (README, "Where things are"): prompts -> rollout worker -> gRPC queue ->
trainer (``satjax.losses`` / ``satjax.objectives``) -> weight sync -> checkpoint.
"""

__version__ = "0.1.0"
