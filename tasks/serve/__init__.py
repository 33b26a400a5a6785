"""Prediction beside the served pyfunc (``tasks.predict``): the model server, the file a
registered version loads its model from, and batch prediction.
"""
