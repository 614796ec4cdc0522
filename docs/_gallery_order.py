"""The tutorials in their numbers' order (plot_2 before plot_10), not the file names'."""

import re

from sphinx_gallery.sorting import FileNameSortKey


class TutorialNumberSortKey(FileNameSortKey):
    """Sort ``plot_<n>_*.py`` by ``n``."""

    def __call__(self, filename: str) -> int:
        return int(re.match(r"plot_(\d+)_", filename)[1])
