"""Tool calling: parsing a model's tool-call syntax out of its text (`parser.py`)."""
