"""An example third-party rollgen backend (``"example"``), installed from its own pyproject."""
