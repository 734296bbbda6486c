"""The back-ends that run device programs (docs/ARCHITECTURE.md); the only package that
imports ray."""

import logging

# In a notebook, `import ray` logs "Missing packages: ['ipywidgets'] ..." into the cell:
# Ray's rich display of its own context, which the emulator never shows.
logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
