"""Multilane's training engine: data-parallel training on torch.nn.parallel, with no Qt anywhere.

The engine runs headless (``multilane train``) and the desktop app is one client of it. Entry points:
``multilane.engine.trainer.Trainer``, ``multilane.engine.config.RunConfig``, ``multilane.engine.tasks``.
"""

__version__ = "0.1.0"
