"""Scale-out on torch.distributed: one process per device, DistributedDataParallel, torch's elastic launcher.

``rank.py`` (who this process is, the process group), ``window.py`` (a rank's log window),
``trainer.py`` (the ddp trainer), ``worker.py`` (a rank's entry point), ``launcher.py`` (starting the
ranks through torch.distributed's elastic agent and reporting how they ended).
"""

from multilane.engine.distributed.rank import RankInfo, in_worker

__all__ = ["RankInfo", "in_worker"]
