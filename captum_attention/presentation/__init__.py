"""Presentation layer: the command line, terminal tables and HTML reports.

Never imported by the capture, maps, attribution or metrics layers.
"""
