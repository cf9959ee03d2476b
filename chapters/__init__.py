"""tinytron: the full lifecycle of one training iteration, as a book and a real trainer."""

__version__ = "0.1.0"
