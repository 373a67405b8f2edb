"""keyed() over every HF architecture of the installed transformers: split invariance and dynamic padding."""
