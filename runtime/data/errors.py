class DataError(Exception):
    """A mistake in the data a user pointed at: reported as one line, never a traceback."""
