"""The manual's tools: ``python -m tools.manual.figures`` draws its figures from real runs; ``docs_hooks.py`` (named
in ``mkdocs.yml``) links its pages to the code."""
