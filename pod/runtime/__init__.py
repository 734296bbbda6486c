"""The runtime: the only package that imports ray or opens sockets.

Ray's C++ failure-signal handler (absl's, installed when ``ray.init`` creates the
driver's core worker) caught a SIGTERM during actor start-up, printed a C++ stack
("*** SIGTERM received ***") and could abort the run (exit -6) before its own
handler wrote the partial summary. Ray reads ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``
when ``ray._raylet`` is imported, so it is set here, before any module of this
package imports ray (a value the user set is kept); ``pod.runtime.cluster`` also
puts a run's own SIGTERM handler back after ``ray.init``.
"""

import os

os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
