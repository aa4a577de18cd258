"""Images as a request brings them: decoding with their limits (image.py), fetching from data: and allowed
http(s) URLs (fetch.py), and each model family's preprocessing into pixel patches and prompt placeholders
(qwen_vl.py). Nothing here runs a network; the engine encodes what this floor prepares."""
