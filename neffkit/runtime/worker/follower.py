"""`python -m neffkit.runtime.worker.follower BUNDLE BACKEND TIMEOUT_S`: one follower rank process.

Started by `neffkit run` for ranks 1..N-1 with the torchrun variables set (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT).
"""

import sys

from neffkit.runtime.worker.distributed import follower_main

if __name__ == "__main__":
    follower_main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
