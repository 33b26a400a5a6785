"""The servers a clone starts and stops on this machine: its Prefect server
(:mod:`~flows.servers.prefect_server`, which every flow entry point requires) and a local
S3-compatible server for tests, the bench and the team demo (:mod:`~flows.servers.s3_server`).
Imports nothing else of ``flows``.
"""
