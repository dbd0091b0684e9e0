"""The GPU check: ``bash tools/gpu_check/run.sh`` on a CUDA machine installs the wheels it brought and runs
``python -m tools.gpu_check.check``, which writes ``docs/gpu-results.md``."""
