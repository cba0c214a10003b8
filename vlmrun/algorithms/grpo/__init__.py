"""Sync GRPO for VLMs: the controller (loop), its stages, the rank actor, rewards, advantages and the
clipped policy-gradient loss, one concern per file. driver.py starts the controller."""
