"""The checkpoint package's error (its own module: core and lock both raise it)."""


class CheckpointError(Exception):
    """A checkpoint that cannot be loaded as asked: missing, incomplete, corrupt, or of another
    model; or a save that cannot happen (the directory is another run's, the disk is full). The
    message is one line and names what does not match."""
