"""The error every part of the test control plane raises, in a module of its own so that the
binaries, PKI and cluster modules share it without importing each other."""


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started, used or stopped as asked."""
