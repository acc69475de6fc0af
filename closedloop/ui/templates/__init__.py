"""Jinja2 templates of the viewer (a package so that setup.py ships them)."""
