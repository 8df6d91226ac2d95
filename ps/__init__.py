"""Parameter-server layout (`--layout ps`): gRPC shard servers hold parameters and optimizer
state on the host; JAX worker processes push gradients and pull parameters. See docs/ps.md."""
