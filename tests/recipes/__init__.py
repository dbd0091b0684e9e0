"""The recipes end to end (``recipes/X.py`` -> ``test_X.py``), ``train.py``'s checks, resume and bad input."""
