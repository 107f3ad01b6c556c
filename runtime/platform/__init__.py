"""What the process runs on: the device and its memory, the heap, and the environment variables
(`runtime.platform.env`, their one reader)."""
