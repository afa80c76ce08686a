"""`agentserve bench peers`: the side-by-side harness (docs/peers.md)."""
