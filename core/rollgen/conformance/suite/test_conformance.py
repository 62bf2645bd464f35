"""Runs every conformance test against ``--rollgen-backend``."""

from rollgen.conformance.base import BackendConformance


class TestConformance(BackendConformance):
    """The contract, as the installed backend named on the command line meets it."""
