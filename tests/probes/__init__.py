"""The probes' proofs, one file per probe (``copy_correct/probes/X.py`` -> ``test_X.py``)."""
