"""A module that ends the process when imported: a preloader that dies
before it is ready, where a cold start (which never imports it) works
(tests/tests/preload.rs)."""

import os

os._exit(5)
