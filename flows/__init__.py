"""Prefect flows that compose the stage tasks."""
