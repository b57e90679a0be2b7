"""Command line: argument parsing and wiring only (no formulas here)."""
