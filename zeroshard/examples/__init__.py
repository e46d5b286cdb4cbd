"""Runnable examples: ``python -m zeroshard.examples.<name> --help``."""
