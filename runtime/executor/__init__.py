"""One step of the model on a paged KV cache: the step plan, the runner that picks eager,
compiled or captured execution once, the KV and recurrent-state caches, and the attention context
each layer calls."""
