"""Tensor parallelism: one engine's model split across N devices (ranks).

plan.py (which slice of each weight a rank holds), layers.py (the communicating layers and a
rank's shard of the model), loading.py (reading only that shard), group.py (the process groups,
commands and the step's compact encoding), leader.py (rank 0, in the worker thread) and rank.py
(ranks 1..N-1, spawned processes).
"""
