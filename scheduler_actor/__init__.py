"""The scheduler: iteration-level admission decisions (pure core) and its actor."""
