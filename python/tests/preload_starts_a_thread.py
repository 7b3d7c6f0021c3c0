"""A module that starts a thread when imported: a preload that must be
refused (test_preload.py)."""

import threading
import time

_THREAD = threading.Thread(target=time.sleep, args=(3600,), name="started-on-import", daemon=True)
_THREAD.start()
