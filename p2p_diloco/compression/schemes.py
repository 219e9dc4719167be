"""The values of ``averaging.compression``, each a rule of :class:`~p2p_diloco.compression.policy.CompressionPolicy`
for which codecs a round's plan names. A module of its own, importing nothing, so that the config checks the key
against this list without importing torch or hivemind."""

SCHEMES = ("none", "fp16", "int8", "lowrank", "adaptive", "sparseloco")
