"""cudamedic core: evidence model, parsers, classifier, fixes (pure) and the remote shell."""

__version__ = "0.1.0"
