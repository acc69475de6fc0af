"""The viewer's stylesheet and script (a package so that setup.py ships them)."""
