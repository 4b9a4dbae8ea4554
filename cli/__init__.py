"""The `cullama` command line: a thin click layer over the library (parsing and printing only)."""
