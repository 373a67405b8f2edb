"""Tests of keyinit.integrations: HF Trainer and Lightning keyed with one call."""
