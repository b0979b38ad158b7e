"""logdx: diagnose why a large training job failed, from its logs."""

__version__ = "0.1.0"
