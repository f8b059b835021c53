"""Apps: thin front ends (the ``torpor`` CLI) that parse input, call the core and render output."""
