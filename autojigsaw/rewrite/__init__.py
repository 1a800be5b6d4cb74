"""The rewrite: a Plan and a captured graph into a local-shard graph with explicit collectives."""
