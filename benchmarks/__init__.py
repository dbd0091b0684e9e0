"""The side-by-side benchmarks against the real peer packages, each run from the repository root as
``python -m benchmarks.NAME`` (``ema``, ``posthoc_ema``, ``target``, ``replay``, ``gan``, ``loading``, ``sharded``, and
``stream``, the machine's memory-bandwidth limit measured as STREAM does); ``report`` writes their sections of
``docs/benchmarks.md``, ``peers`` finds the installed peer libraries."""
