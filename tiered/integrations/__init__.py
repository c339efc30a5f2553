"""Integrations with training frameworks (optional extras): `tiered.integrations.hf` for
Hugging Face's Trainer and TRL."""
