"""The ``pykv`` admin CLI: thin shells over ``pykv.maintenance`` (see ``app.py``)."""
