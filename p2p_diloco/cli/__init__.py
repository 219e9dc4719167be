"""The ``p2p-diloco`` command line; see :mod:`p2p_diloco.cli.main`."""
