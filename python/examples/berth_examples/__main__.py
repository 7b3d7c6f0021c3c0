"""``python3 -m berth_examples``: a berth worker offering the examples."""

import berth_worker

from . import BACKENDS

if __name__ == "__main__":
    berth_worker.serve(BACKENDS)
