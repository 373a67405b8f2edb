"""keyinit.nn.compile: a keyed forward under torch.compile draws what the eager keyed forward draws."""
