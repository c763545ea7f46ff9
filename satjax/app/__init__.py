"""The application around the library: CLI, process launching, signals, lag sweep, reports."""
