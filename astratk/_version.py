"""The package version, in one place (the front door re-exports it; exports record it)."""

__version__ = "0.1.0"
