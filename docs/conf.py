"""Sphinx configuration for captum-attention.

The tutorials (``tutorials/plot_*.py``) are executed by sphinx-gallery on every build, and
their output and figures rendered into the pages. ``-D plot_gallery=0`` renders them
without running them.
"""

import datetime
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _gallery_order

project = "captum-attention"
author = "captum-attention developers"
copyright = f"2025-{datetime.date.today().year}, {author}"
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "sphinx_gallery.gen_gallery",
    "sphinx-mathjax-offline",
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
html_theme = "furo"
html_title = "captum-attention"
exclude_patterns = ["_build"]

# The registered methods, named in the pages as |methods| (generated: a new method appears everywhere).
from captum_attention import METHODS  # noqa: E402

_NAMES = [cls.get_name() for cls in METHODS.values()]
rst_prolog = f".. |methods| replace:: {', '.join(_NAMES[:-1])} and {_NAMES[-1]}\n.. |method_count| replace:: {len(_NAMES)}\n"
suppress_warnings = ["ref.python"]

# The tutorials run offline, on the threads of a small machine, and never on a GPU.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sphinx_gallery_conf = {
    "examples_dirs": "../tutorials",
    "gallery_dirs": "tutorials",
    "filename_pattern": r"/plot_",
    "capture_repr": ("_repr_html_", "__repr__"),
    "image_scrapers": ("matplotlib",),
    "matplotlib_animations": False,
    "remove_config_comments": True,
    "download_all_examples": False,
    "show_memory": False,
    "within_subsection_order": "_gallery_order.TutorialNumberSortKey",
    # no execution-time pages: they pull jQuery, DataTables and Bootstrap from CDNs, and the
    # site works offline
    "write_computation_times": False,
}
