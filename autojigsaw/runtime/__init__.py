"""The module users get back: DTensor parameters outside, the rewritten local graph inside."""
