"""Built-in job plugins."""
