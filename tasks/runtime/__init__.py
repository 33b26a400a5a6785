"""What every wing runs on: params, the layout of a project, atomic writes, processes and
their cost, code versions, the workspace lock, TensorFlow's imports, metrics files, where runs
are tracked, refusals, the accelerator and a dataset's identity. Imports no other wing.
"""
