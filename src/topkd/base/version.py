"""topkd's version, in a module of its own: the layers that record it (cache fingerprints, result stamps) read it
here, not through the `topkd` facade, which imports the loss and the cache reader."""

__version__ = "0.1.0"
