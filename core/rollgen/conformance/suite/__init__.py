"""The conformance tests, collected with ``--pyargs rollgen.conformance.suite``."""
