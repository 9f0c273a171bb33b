"""`echo-tp eval`: perplexity under several comm configs (perplexity.py)."""
from .perplexity import EvalOptions, format_table, main, sliding_windows, window_nll

__all__ = ["EvalOptions", "main", "sliding_windows", "window_nll", "format_table"]
