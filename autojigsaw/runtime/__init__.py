"""The runtime: the module users get back (DTensor parameters outside, the local graph inside), materialization, loading."""
