"""rollgen's Hugging Face transformers backend (``"hf"``): the CPU reference implementation."""
