"""Benchmarks of the attention engine against reference implementations (`make bench`)."""
