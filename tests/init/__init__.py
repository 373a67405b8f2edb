"""Initializing models: keyinit.init, init_model and materialize, plans, layouts and rule precedence, on one and on many ranks."""
