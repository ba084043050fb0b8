"""Native kernels the torch path cannot express efficiently (built on first use, optional)."""
