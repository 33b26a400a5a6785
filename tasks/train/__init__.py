"""The train stage: the model builders, the training loop and its device strategy, backups a
killed run resumes from, callbacks, the child process and the cluster, the model file.
"""
