"""p2p-diloco: peer-to-peer DiLoCoX training of language models on hivemind."""

import os

# hivemind switches torch to the "file_system" sharing strategy, whose torch_shm_manager helper process
# dies with the process group on Ctrl-C/SIGTERM and then aborts every process that frees a shared tensor.
# Our averager shares its buffers with the (forked) averager process, where "file_descriptor" works.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")

__version__ = "0.1.0"
