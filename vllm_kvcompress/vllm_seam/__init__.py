"""The only code that imports vLLM internals. See patches.py for the full list."""
