"""The errors of distributed checkpoints and the name of DCP's metadata file, apart from
:mod:`.storage` so that catching them or looking for a checkpoint's files does not import
``torch.distributed.checkpoint`` (about a second of start-up per process, with DTensor and sympy)."""

METADATA_FILE = ".metadata"


class CheckpointFormatError(RuntimeError):
    """A distributed checkpoint is unreadable, refused, or does not hold what the model needs."""


class CheckpointWriteError(RuntimeError):
    """Writing a distributed checkpoint failed on some rank (e.g. a full disk)."""
