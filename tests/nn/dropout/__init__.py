"""Keyed dropout as an op: keyinit.nn.functional.dropout, attention dropout, and the forward keyed() gives each nn.Dropout."""
