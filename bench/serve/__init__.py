"""Benchmarks that drive a running server: the serve workload (`workload`), vLLM's own client
against both servers (`vs_vllm`), a lone request through the server against `LLM.generate`
(`lone_request`), a served token's time split by thread (`profile`), and the split-process
prototype (`split_server`)."""
