"""The host process: its memory (host/memory.py) and huge-page mappings for the weights (host/huge_pages.py)."""
