"""Factory ops: arange, full, eye, linspace, ... (device given by argument)."""
