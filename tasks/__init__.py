"""Shardflow stage logic: one module per stage plus the contracts stages share."""
