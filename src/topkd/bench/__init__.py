"""topkd.bench: benchmarks that print ratios measured in one run (`topkd bench loss`)."""
