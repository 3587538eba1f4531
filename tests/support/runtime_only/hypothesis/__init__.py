"""Not Hypothesis: the ``hypothesis`` that the kiproxy processes the tests start find first.

kio imports Hypothesis whenever it is installed (for strategies of its types), and the
test extra installs it, so every proxy the tests started imported it: about 0.4 s of
CPU a start, a third of the start-up, which no installed proxy pays (Hypothesis is not
a dependency of the runtime). Importing this fails as a missing package does; kio
then goes on without it. See ``support.processes.runtime_env``.
"""

raise ModuleNotFoundError("No module named 'hypothesis'", name="hypothesis")
