"""Token choice: the sampler (greedy, temperature, top-k/top-p, seeded streams, logprobs) and the
grammar masks of structured outputs."""
