"""One ddp or fsdp rank on a process group of one, in a process of its own (test_rank_in_process.py):
``python rank_of_one.py CONFIG.json`` with torch's launcher environment (RANK, WORLD_SIZE, MASTER_ADDR,
...) set by the test; it runs the rank's entry point, ``rank_main``, as a launcher's forked rank does,
and exits with its return code."""

import json
import sys

from multilane.engine.config import build_config
from multilane.engine.distributed.worker import rank_main

if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        sys.exit(rank_main(build_config(json.load(f)), None, {}))
