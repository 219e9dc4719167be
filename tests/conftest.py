"""Test-wide set-up: the same torch sharing strategy that p2p_diloco uses, set before hivemind is imported."""

import os

os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")
