"""A plugin whose import fails, as a typo would."""

raise ImportError("No module named 'jsonschemaa' (simulated typo in the plugin)")
