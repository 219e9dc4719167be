"""p2p-diloco: peer-to-peer DiLoCoX training of language models on hivemind."""

__version__ = "0.1.0"
