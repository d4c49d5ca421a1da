"""Held-out evaluation: loss, perplexity and bits per byte under any training layout."""
