"""Scores from the cache: per-(layer, KV group) scores (native kernels) and their aggregation to
one score per token, since llama.cpp evicts whole cells (every layer and head at once)."""
