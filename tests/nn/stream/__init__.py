"""What keyed forwards draw, pinned: golden vectors of spec 14 (dropout keys, keyed draws, stream v2 names)."""
