"""The project's own tools, run from the repository root: ``tools.manual`` (the manual's figures and docs hooks) and
``tools.gpu_check`` (the GPU check). Nothing here is installed, and no training code imports it."""
