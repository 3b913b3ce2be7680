"""Command line and (later) HTTP entry points."""
