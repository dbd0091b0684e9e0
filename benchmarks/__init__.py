"""The side-by-side benchmarks against the real peer packages, each run from the repository root as
``python -m benchmarks.NAME`` (``ema``, ``target``, ``replay``, ``gan``, ``loading``, ``sharded``); ``report`` writes
their sections of ``docs/benchmarks.md``, ``peers`` finds the installed peer libraries."""
