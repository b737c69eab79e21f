"""Runnable examples: ``python -m moed.examples.ep_generate --model qwen3_moe --ranks 4``."""
