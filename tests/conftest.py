"""pytest runs against this checkout's src/ (pyproject: pythonpath), whatever is installed."""
