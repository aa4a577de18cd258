"""Token price presets for `sudu bench --price NAME`: one JSON file per public price list, each saying where
its figures come from and their date (read by sudu/bench/cost.py)."""
