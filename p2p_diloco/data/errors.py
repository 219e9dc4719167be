"""The data subsystem's exception type."""


class DataError(ValueError):
    """Bad input data (missing or corrupt shards, unreadable corpus, unusable tokenizer...).

    The message names the file or folder at fault and what is wrong with it.
    """
