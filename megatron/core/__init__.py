"""Core library: parallel layout, models, optimizers, checkpointing and inference."""
