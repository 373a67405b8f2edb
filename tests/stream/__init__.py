"""The random stream itself: keys and their derivation, Philox, the samplers, regions, golden vectors of stream v1, errors."""
