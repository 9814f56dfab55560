"""The self-contained HTML report that `prorsa demo`, `prorsa rollout` and `prorsa bench` write with `--report DIR`.

`sources` turns each command's results (simulator JSON, live recordings) into `RunData`; `figures` draws them as
inline SVG; `page` writes one HTML file that needs nothing else to open.
"""

from prorsa.report.model import RunData
from prorsa.report.page import Report, write_report
from prorsa.report.sources import from_error, from_live, from_sim_json

__all__ = ["Report", "RunData", "from_error", "from_live", "from_sim_json", "write_report"]
