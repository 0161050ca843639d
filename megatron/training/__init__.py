"""Training entry-point support: flags, initialization, the train loop, checkpoints, logging."""
