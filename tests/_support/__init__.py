"""Helpers the tests share (no tests here): real gloo ranks, the HF and vision zoos, shared models, the split harness."""
