"""Will it fit: the memory a run will need, measured by a probe before it starts, and its peak measured as it trains."""
