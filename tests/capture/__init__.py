"""Existing init code captured on stand-ins and replayed per region: what it may do and what a capture refuses."""
