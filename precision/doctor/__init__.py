"""The numerics doctor: where half precision goes wrong, and the verified fix.

:func:`diagnose` (``precision.diagnose``) builds the program the policy runs
(forward, and backward with a loss), evaluates it once with every op probed (:mod:`.probe`: each result read in
float32, next to the same op computed in float32), turns the probes into
statistics and problems per module and pass (:mod:`.analysis`), tries the
changes that could fix each problem on the program again (:mod:`.examine`) and
reports what it saw and verified (:mod:`.report`). The training step itself is
never changed: the probed program is a separate one.
"""

from precision.doctor.analysis import THRESHOLDS, ModuleStats, Problem
from precision.doctor.examine import diagnose
from precision.doctor.report import Diagnosis, Recommendation

__all__ = ["THRESHOLDS", "Diagnosis", "ModuleStats", "Problem", "Recommendation", "diagnose"]
