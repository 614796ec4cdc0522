"""Sphinx configuration for captum-attention."""

project = "captum-attention"
author = "captum-attention developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax", "sphinx.ext.viewcode"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
html_theme = "alabaster"
exclude_patterns = ["_build"]
suppress_warnings = ["ref.python"]
