"""Averaging pseudo-gradients with the same stage of other peers: hivemind's averager made exact (bit-identical
results), robust to hostile groupmates, and compressed; every hivemind internal it needs goes through
:mod:`~p2p_diloco.hivemind_adapter.averaging`."""
