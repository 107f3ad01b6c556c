"""`metrale bench`: the concurrency sweep, its record and plot, the prompt corpus."""
