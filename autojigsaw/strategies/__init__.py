"""Strategies: every node's legal ways to run on local shards (own rules, DTensor's, data-axis pins)."""
