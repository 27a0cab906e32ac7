"""Models larger than one device: the ``fsdp`` strategy on torch's FSDP2 (``fully_shard``).

``units.py`` (which modules become FSDP units, the mixed-precision policy), ``trainer.py`` (the ddp
trainer with the model sharded instead of replicated), ``sharded.py`` (checkpoints written with
``torch.distributed.checkpoint``, crash-safe, readable by every strategy), ``safe_reader.py`` (a DCP
folder read as data: its pickled metadata through an allowlist, never code). The ranks are started by
the ddp launcher (``engine/distributed/launcher.py``). See docs/fsdp.md.
"""
