"""cudamedic's pipeline, one package per stage, lowest first: ``core`` (what every stage uses),
``knowledge`` (data with sources), ``collect`` (hosts -> evidence bundle), ``diagnose`` (bundle ->
verdict and proposed remedy), ``fix`` (plan, approve, recreate, verify, roll back) and ``cli``
(the ``cudamedic`` command). A stage imports only itself and the stages before it
(tests/test_imports.py). The packaged runbooks ``incident.yaml`` and ``sweep.yaml`` live here."""

__version__ = "0.1.0"
