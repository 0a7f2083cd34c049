"""Benchmarks and accuracy studies (importable, tested at tiny sizes)."""
