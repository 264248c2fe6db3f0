"""The doctor: tools that examine a Python environment rather than run a pipeline.

`checkup.examine` describes this process (packages, native runtimes, CUDA, fork hazards), `imports`
finds the import order that crashes, `repeat` measures a command's crash rate, `wheel` patches and
serves wheels. The pipeline runtime never imports this package (tests/test_layering.py): a pipeline pays
nothing for the doctor, and the doctor may use any part of the runtime.
"""

from .checkup import Finding, Report, examine, runs_on
from .imports import Cell, import_matrix

__all__ = ["examine", "Report", "Finding", "runs_on", "import_matrix", "Cell"]
