"""The GPU worker: the model, the paged K/V cache and the selective-batched engine step."""
