"""rollgen's SGLang backend (``"sglang"``): offline ``sglang.Engine`` in Ray actors."""
