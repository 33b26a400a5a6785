"""The ``shardflow`` command (:mod:`~flows.cli.shardflow`, also ``python -m flows.cli``) and
the commands it runs as their own processes: :mod:`~flows.cli.accept_data`,
:mod:`~flows.cli.promote`, :mod:`~flows.cli.retract`, :mod:`~flows.cli.lineage`, the process
that serves the deployments (:mod:`~flows.cli.deployments`) and the summary a run ends with
(:mod:`~flows.cli.run_summary`). Nothing below imports it.
"""
