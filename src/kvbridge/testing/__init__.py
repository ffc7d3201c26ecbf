"""Harnesses shared by the tests, the benches and the reliability report (rank processes, scenarios).

The library never imports this package.
"""
