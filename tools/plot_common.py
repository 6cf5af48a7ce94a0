"""What the plotting scripts share: matplotlib drawing to files, and one colour per KV policy.

Imported by plot_bench.py and plot_eval.py, which find it beside them (a script's own directory
is first on sys.path), in the source tree or installed in share/infinigen/tools.
"""

import matplotlib

# No display: the scripts only write PNG files.
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402, F401  (re-exported to the scripts)

POLICY_COLORS = {
    "gpu": "#4d4d4d",
    "full": "#d62728",
    "int4": "#ff7f0e",
    "h2o": "#2ca02c",
    "infinigen": "#1f77b4",
}
