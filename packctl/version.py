"""The packctl version, in a module of its own so every part can import it without cycles."""
__version__ = "0.1.0"
