"""Developer tooling: the llama-server build, the tiny model, the embedded Redis, process stacks."""
