"""What every layer above needs: sampling, row keys, sharding, guidance, the decode config, compilation, the
target prefill and provenance. Imports nothing of jspec above it."""
