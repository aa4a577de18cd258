"""The CLI's commands, one file each: serve, generate, roofline, cache (`sudu bench` lives with bench/, `sudu
models` with weights/catalog.py). Each parses its flags and calls the floors below; sudu/cli.py dispatches."""
