"""The GPU jobs as data (table.py) and their one runner (runner.py); usage: __main__.py."""
