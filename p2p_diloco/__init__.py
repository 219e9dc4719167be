"""p2p-diloco: peer-to-peer DiLoCoX training of language models on hivemind."""

import os

# hivemind switches torch to the "file_system" sharing strategy, whose torch_shm_manager helper process
# dies with the process group on Ctrl-C/SIGTERM and then aborts every process that frees a shared tensor.
# Our averager shares its buffers with the (forked) averager process, where "file_descriptor" works.
os.environ.setdefault("HIVEMIND_MEMORY_SHARING_STRATEGY", "file_descriptor")


DISTRIBUTION = "p2p-diloco"


def installed_version(distribution: str = DISTRIBUTION) -> str | None:
    """The version of the installed distribution, from its package metadata (pyproject.toml's ``version``, recorded
    by ``pip install``); None when it is not installed (a bare checkout on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def __getattr__(name: str) -> str:
    # __version__ is read from the metadata when asked: the metadata lookup scans sys.path, which every import
    # of the package would otherwise pay
    if name == "__version__":
        return installed_version() or "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
