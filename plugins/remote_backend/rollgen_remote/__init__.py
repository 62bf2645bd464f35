"""The ``remote`` backend: a client of a ``rollgen serve`` endpoint, over HTTP."""
