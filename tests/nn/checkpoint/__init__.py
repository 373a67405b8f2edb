"""Activation checkpointing under keyed(): the recompute draws the first execution's values and leaves nothing behind."""
