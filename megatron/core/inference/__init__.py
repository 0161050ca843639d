"""Dynamic inference: paged KV cache and Mamba state contexts, engine, sampling, serving."""
