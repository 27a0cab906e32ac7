"""The device layer: torch.nn.parallel's scatter → replicate → parallel_apply → gather, on GPUs or CPU lanes."""

from multilane.engine.parallel.backend import Backend, make_backend
from multilane.engine.parallel.persistent import PersistentReplicas
from multilane.engine.parallel.split import chunk_sizes
from multilane.engine.parallel.strategies import STRATEGIES, make_strategy
from multilane.engine.parallel.strategy import ReplicateEachStep, StepOutput

__all__ = [
    "STRATEGIES",
    "Backend",
    "PersistentReplicas",
    "ReplicateEachStep",
    "StepOutput",
    "chunk_sizes",
    "make_backend",
    "make_strategy",
]
