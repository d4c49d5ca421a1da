"""Using a trained model: KV-cache decoding, sampling, loading weights for inference, and generation."""
