"""Weight formats below the layers: formats.py (int8 / int4 math, tiles, GGUF Q8_0 blocks as int8). Layers never
choose a format; they run the one they are given."""
