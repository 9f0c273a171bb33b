"""`echo-tp eval`: perplexity under several comm configs (perplexity.py: what it computes)."""
from .config import EvalOptions
from .metric import sliding_windows, window_nll
from .runner import main
from .table import format_table

__all__ = ["EvalOptions", "main", "sliding_windows", "window_nll", "format_table"]
