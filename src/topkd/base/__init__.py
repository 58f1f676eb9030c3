"""The base layer: small modules every layer may import, which import no other layer (tests/test_layers.py):
files (atomic writes, locks), dist, memory, progress, signals, checks, stamp, tiles, trace, rows, version."""
